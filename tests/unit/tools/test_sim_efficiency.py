"""scripts/sim_efficiency.py's confirmation run: auto against each cell's best mode, chosen before the run."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.script_modules import load_script


@pytest.fixture
def efficiency(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("sim_efficiency", monkeypatch)


def record(mode: str, temperature: float, speedup: float, rates: list[float]) -> dict[str, Any]:
    """A bench record whose prompt p ran 64 tokens at rates[p] tokens/s."""
    per_request = [{"prompt_id": f"p{i}", "tokens": 64, "seconds": 64 / r} for i, r in enumerate(rates)]
    return {"mode": mode, "temperature": temperature, "speedup": speedup, "per_request": per_request}


def test_draft_lengths_come_from_chain_modes_only(efficiency: ModuleType) -> None:
    assert [efficiency._draft_length(m) for m in ("fixed-3", "speccache-2", "postverify-4")] == [3, 2, 4]
    trees = ("tree-16", "tree-16x2", "pipelined-tree-16", "pipelined-tree-8x2")
    assert [efficiency._draft_length(m) for m in ("target-only", "auto", *trees)] == [None] * 6


def test_the_confirmed_ratio_comes_from_the_second_run_of_the_grid_s_best_mode(
    efficiency: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    grid = [
        record("target-only", 0.7, 1.0, [100.0] * 4),
        record("fixed-2", 0.7, 1.30, [130.0] * 4),
        record("speccache-2", 0.7, 1.50, [150.0] * 4),  # its lead here is luck: it runs again below
        record("auto", 0.7, 1.35, [135.0] * 4),
    ]
    row = efficiency.summarise("h100-8b", 0.8, 0.7, grid)
    assert row["best_fixed"] == "speccache-2" and row["auto_over_best_fixed"] == pytest.approx(0.9)
    asked: dict[str, Any] = {}

    def bench(profile: str, agreement: float, args: argparse.Namespace, out: Path, **kw: Any) -> list[dict[str, Any]]:
        asked.update(kw)
        return [
            record("target-only", 0.7, 1.0, [100.0] * 6),
            record("speccache-2", 0.7, 1.40, [140.0] * 6),
            record("auto", 0.7, 1.38, [138.0] * 6),
        ]

    monkeypatch.setattr(efficiency, "bench", bench)
    args = argparse.Namespace(confirm_prompts=6)
    efficiency.confirm("h100-8b", 0.8, [row], args, tmp_path / "c.json")
    assert asked == {"modes": ["target-only", "speccache-2", "auto"], "prompts": 6, "seed": 1000}
    assert row["confirm_mode"] == "speccache-2"
    assert row["confirm_auto_over_best"] == pytest.approx(1.38 / 1.40)
    low, high = row["confirm_auto_over_best_90"]
    assert low == pytest.approx(138 / 140) and high == pytest.approx(138 / 140)  # every prompt alike
    assert row["confirm_auto_speedup"] == pytest.approx(1.38)
    assert row["auto_over_best_fixed"] == pytest.approx(0.9)  # the grid's own figure stays beside it
