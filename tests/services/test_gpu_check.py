"""scripts/gpu_check.sh --dry-run: every step of the device check runs on the CPU at tiny sizes.

What CI keeps working for the GPU window (docs/gpu.md): the device-marked tests, the
verify-cost curve and decode steps, the distill run, and the outputs: a summary whose figures
are all there and a profile that specd's own loader accepts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specd.core.model.sim.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
NEWS = ["1", "2", "4", "8", "16", "32", "64"]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check-out")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("SPECD_TEST_DEVICE", None)
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=880
    )
    assert done.returncode == 0, f"dry run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert "gpu_check: ok in" in done.stdout
    return out


def test_the_outputs_are_the_files_that_come_back(dry_run: Path) -> None:
    names = sorted(p.name for p in dry_run.iterdir())
    assert len(names) <= 8, names  # at most 8 files come back from the device
    for name in ("gpu-check.log", "summary.json", "h200-measured.json", "tests.xml", "distill-summary.json"):
        assert name in names
    assert all((dry_run / n).stat().st_size <= 16 * 1024 * 1024 for n in names)


def test_summary_holds_every_measurement(dry_run: Path) -> None:
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["dry_run"] is True
    tests = summary["tests"]
    assert tests["ran"] and tests["tests"] > 50 and tests["failures"] == tests["errors"] == 0, tests
    for role in ("target", "draft"):
        ratios = summary["verify_cost"][role]["ratios"]
        assert sorted(ratios, key=int) == ["1", "8", "32"]
        for batch, curve in ratios.items():
            assert sorted(curve, key=int) == NEWS, (role, batch)
            assert curve["1"] == 1.0 and all(r > 0 for r in curve.values())
        decode = summary["decode_step"][role]
        assert decode["specd_runner_step_ms"] > 0 and decode["transformers_generate_step_ms"] >= 0
        assert "no static-cache" in decode["static_cache_compile"]
        assert summary["fitted_cost"][role]["fixed_ms"] >= 0
    distill = summary["distill"]
    assert distill["ran"] and distill["steps"] > 0
    assert 0.0 <= distill["heldout_top1_agreement_final"] <= 1.0


def test_profile_loads_with_the_sim_loader(dry_run: Path) -> None:
    profile = load_profile(str(dry_run / "h200-measured.json"))
    assert profile.name == "gpu-check-dry-run"  # a dry run never poses as the H200 profile
    for role in ("target", "draft"):
        cost = profile.cost(role)
        assert cost.forward_ms([1], [33]) > 0
    assert profile.measured["dry_run"] is True
