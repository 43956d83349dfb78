"""The emulator's cost model fitted to a measured verify-cost curve, written as a sim profile.

specd.core.model.sim.cost.CostModel says one forward over B sequences, n_b new positions after
c_b cached ones, takes

    fixed + per_seq * B + per_kv_token * sum_b (c_b + n_b) + per_token * max(0, sum_b n_b - free_tokens)

The fit: for each candidate free_tokens (0 and every B * n measured), least squares of the
other four terms, none negative (a term that comes out negative is dropped and the rest
refitted); the candidate with the smallest squared error wins. Points at two context
lengths separate the KV term from the per-sequence one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.profile import PROFILES_DIR
from specd.tools.gpu_check.verify_curve import CurvePoint

__all__ = ["fit_cost_model", "profile_json", "write_json"]

_TERMS = ("fixed_ms", "per_seq_ms", "per_kv_token_ms", "per_token_ms")


def _design(points: list[CurvePoint], free: int) -> np.ndarray:
    rows = [[1.0, p.batch, p.batch * (p.context + p.new), max(0, p.batch * p.new - free)] for p in points]
    return np.array(rows, dtype=np.float64)


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with every coefficient >= 0: drop the most negative column until none is."""
    keep = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    residual = y - a @ coef
    return coef, float(residual @ residual)


def fit_cost_model(points: list[CurvePoint]) -> CostModel:
    y = np.array([p.median_ms for p in points], dtype=np.float64)
    candidates = sorted({0} | {p.batch * p.new for p in points})
    best: tuple[float, int, np.ndarray] | None = None
    for free in candidates:
        coef, err = _nonneg_lstsq(_design(points, free), y)
        if best is None or err < best[0] - 1e-12:
            best = (err, free, coef)
    assert best is not None  # points is never empty here
    _, free, coef = best
    values = {name: round(float(c), 6) for name, c in zip(_TERMS, coef)}
    return CostModel(free_tokens=int(free) if values["per_token_ms"] > 0 else 0, **values)


def _side(model: str, hardware: str, kv_bytes: int, cost: CostModel) -> dict[str, Any]:
    return {"model": model, "hardware": hardware, "kv_bytes_per_token": kv_bytes, "cost": vars(cost)}


def profile_json(
    *,
    name: str,
    description: str,
    target: tuple[str, str, int, CostModel],  # (model, hardware, kv bytes per token, fitted cost)
    draft: tuple[str, str, int, CostModel],
    measured: dict[str, Any],
    base: str = "h100-8b",
) -> dict[str, Any]:
    """A profile in the shipped format: `base`'s token-space shape and agreement, measured costs."""
    shipped = json.loads((PROFILES_DIR / f"{base}.json").read_text())
    return {
        "name": name,
        "description": description,
        "vocab_size": shipped["vocab_size"],
        "max_context": shipped["max_context"],
        "shape": shipped["shape"],
        "agreement": shipped["agreement"],
        "target": _side(*target),
        "draft": _side(*draft),
        "measured": measured,
        "notes": [
            f"Costs fitted by specd.tools.gpu_check.profile_fit to verify forwards timed with specd's runner "
            f"(random weights; timing depends on shape and dtype only). Token space, shape and agreement are "
            f"{base}'s (they describe the model pair's distributions, not the hardware).",
        ],
        "sources": [
            {
                "figure": "scripts/gpu_check.sh: T(n) for n new tokens per session at batch B, medians",
                "url": "docs/gpu.md",
                "used_for": "every cost term of target and draft",
            }
        ],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
