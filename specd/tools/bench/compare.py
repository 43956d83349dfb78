"""Every record against target-only: speed-up, efficiency and the greedy (T = 0) correctness check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specd.tools.bench.learning import warmup_curve
from specd.tools.bench.modes import BASELINE, RUNNER_HF, RUNNER_SERVICE
from specd.tools.bench.records import row_name


def finish_records(
    records: list[dict[str, Any]], outputs: Mapping[tuple[str, str, float, int], Mapping[str, list[int]]]
) -> dict[str, Any]:
    """Fill speed-up and efficiency (vs target-only of the same cell) and the greedy check; return its summary.

    Greedy reference: target-only's outputs in the first temperature-0 cell run.
    """
    base = {(r.get("services", ""), r["temperature"], r["concurrency"]): r for r in records if r["mode"] == BASELINE}
    for r in records:
        b = base.get((r.get("services", ""), r["temperature"], r["concurrency"]))
        if (
            b is None and r["runner"] == RUNNER_HF
        ):  # the HF baseline runs at 1 client; compare with the 1-client baseline
            b = base.get((r.get("services", ""), r["temperature"], 1))
        if b and r.get("per_request") and b.get("per_request"):
            r["warmup_curve"] = warmup_curve(r["per_request"], b["per_request"])
        if b and b["tokens_per_s"] and r["tokens_per_s"] is not None:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
            if r["theoretical_speedup"]:
                r["efficiency"] = r["speedup"] / r["theoretical_speedup"]
            if r.get("theoretical_speedup_measured_verify"):
                r["efficiency_measured_verify"] = r["speedup"] / r["theoretical_speedup_measured_verify"]
    greedy_cells = [key for key in outputs if key[2] == 0.0]
    ref_key = next((key for key in greedy_cells if key[1] == BASELINE), None)
    failures: list[dict[str, Any]] = []
    checked = 0
    if ref_key is not None:
        reference = outputs[ref_key]
        for r in records:
            key = (r.get("services", ""), r["mode"], r["temperature"], r["concurrency"])
            if r["temperature"] != 0.0 or key not in outputs:
                continue
            checked += 1
            mismatches: list[dict[str, Any]] = []
            for pid, ref in reference.items():
                got = outputs[key].get(pid)
                if got is None:
                    mismatches.append({"prompt": pid, "first_diff": None, "why": "no output (request failed)"})
                elif got != ref:
                    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                    mismatches.append({"prompt": pid, "first_diff": first, "len": len(got), "reference_len": len(ref)})
            r["greedy_identical"] = not mismatches
            r["greedy_mismatches"] = mismatches
            if mismatches:
                failures.append(
                    {
                        "mode": row_name(r),
                        "concurrency": r["concurrency"],
                        "runner": r["runner"],
                        "prompts": [m["prompt"] for m in mismatches],
                    }
                )
    return {
        "reference": f"{BASELINE} at temperature 0, {ref_key[3]} client(s)" if ref_key else None,
        "records_checked": checked,
        "identical": not [f for f in failures if f["runner"] == RUNNER_SERVICE] if ref_key else None,
        "peer_identical": not [f for f in failures if f["runner"] == RUNNER_HF] if ref_key else None,
        "failures": failures,
    }
