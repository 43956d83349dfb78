"""`specd bench --sim PROFILE` as a run: the profile list from the command, and the emulated services behind it (contract in issue 16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specd.core.model.sim import list_profiles, parse_sim_spec
from specd.tools.bench.sim import sim_cost
from tests.bench_run import RunBench

REPO = Path(__file__).resolve().parents[2]


def test_list_sim_profiles_prints_one_name_per_line():
    out = subprocess.run(
        [sys.executable, "-m", "specd.tools.cli", "bench", "--list-sim-profiles"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.splitlines() == list_profiles()


def test_bench_on_an_emulated_pair_writes_the_contract_records(tmp_path: Path, run_bench: RunBench) -> None:
    """End to end: three services on sim:PROFILE, every mode of the contract, records and labels."""

    spec = "h100-8b,vocab_size=2048,time_scale=0.5"
    report, out = run_bench(
        "--sim",
        spec,
        "--cache-dir",
        str(tmp_path / "cache"),
        "--modes",
        "target-only,fixed-4,pipelined-4,postverify-4,speccache-4,auto",
        "--prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--temperatures",
        "0,1",
        "--concurrency",
        "1,2",
    )
    records = report["records"]
    assert {r["mode"] for r in records} == {
        "target-only",
        "fixed-4",
        "pipelined-4",
        "postverify-4",
        "speccache-4",
        "auto",
    }
    assert len(records) == 6 * 2 * 2
    for r in records:
        for key in (
            "mode",
            "concurrency",
            "temperature",
            "tokens_per_s",
            "speedup",
            "acceptance_rate",
            "round_overhead_ms_p50",
            "round_overhead_ms_p99",
        ):
            assert key in r, key
        assert r["errors"] == 0 and r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["round_overhead_ms_p50"] is not None and 0 <= r["round_overhead_ms_p50"] <= r["round_overhead_ms_p99"]
    spec_records = [r for r in records if r["mode"] not in ("target-only", "auto")]  # auto may not draft yet
    assert all(r["acceptance_rate"] is not None and r["acceptance_rate"] > 0.2 for r in spec_records)
    assert report["meta"]["correctness"]["identical"] is True  # greedy equal to target-only in every mode
    meta = report["meta"]["emulated"]
    assert meta["label"] == "emulated" and meta["spec"] == parse_sim_spec("sim:" + spec).spec
    assert report["meta"]["cost"]["service"]["c"] == pytest.approx(
        sim_cost(parse_sim_spec("sim:" + spec), 1, [4])["c"], rel=0.05
    )
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# specd bench (emulated: h100-8b)") and "Every figure below is emulated" in md
    assert "overhead p50 ms" in md
    cache = [r for r in records if r["mode"] == "speccache-4"]
    # a cell without a hit (2 prompts of 12 tokens can miss every time) reports no table: None
    assert all(sum((r["pipeline_hits_by_outcome"] or {}).values()) == r["pipeline_hits"] for r in cache)
    assert any(r["pipeline_hits"] for r in cache) and "Pipeline hits by the verdict" in md
    assert out.with_suffix(".png").stat().st_size > 0
