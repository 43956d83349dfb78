"""One record per (mode, temperature, clients) cell: throughput, acceptance, theory, latencies."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from specd.tools.bench.modes import RUNNER_SERVICE, Mode
from specd.tools.bench.results import RequestResult
from specd.tools.bench.stats import (
    alpha_from_acceptance_length,
    alpha_from_rounds,
    expected_tokens_per_round,
    mixed_speedup,
    percentile,
    theoretical_speedup,
)


def _drafted_for_fixed(round_tokens: Sequence[int], k: int, max_new_tokens: int) -> list[int]:
    """Draft tokens per round for a fixed-K request: min(K, remaining - 1), as the coordinator's draft_budget."""
    out, generated = [], 0
    for n in round_tokens:
        out.append(max(0, min(k, max_new_tokens - generated - 1)))
        generated += n
    return out


def summarize(
    mode: Mode,
    temperature: float,
    concurrency: int,
    results: Sequence[RequestResult],
    wall_s: float,
    *,
    max_new_tokens: int,
    cost: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One record: throughput, acceptance, theory vs measurement, latencies (speed-up and greedy check come later)."""
    ok = [r for r in results if r.error is None]
    tokens = sum(len(r.token_ids) for r in ok)
    tree = int(mode.request.get("tree_budget", 0))  # > 0: a tree mode; draft tokens count its nodes
    rec: dict[str, Any] = {
        "mode": mode.name,
        "runner": mode.runner,
        "request": dict(mode.request),
        "temperature": temperature,
        "concurrency": concurrency,
        "draft_length": mode.draft_length,
        "tree_budget": tree or None,
        "tree_depth": mode.request.get("draft_length") if tree else None,
        "prompts": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "speedup": None,
    }
    # -- rounds and acceptance
    accepted_rounds = [max(0, n - 1) for r in ok for n in r.round_tokens]
    per_round_drafted: list[int] | None = None
    if mode.hf_baseline:
        drafted = [d for r in ok for d in (r.drafted or [0] * len(r.round_tokens))]
        per_round_drafted = drafted
        drafts, draft_tokens = sum(1 for d in drafted if d > 0), sum(drafted)
        accepted = sum(min(a, d) for a, d in zip(accepted_rounds, drafted))
        rounds, target_only_rounds, pipeline_hits = len(drafted), 0, None
        hits_by_outcome: dict[str, int] | None = None
        per_position_source = "stream" if mode.request.get("assistant", True) else None
    else:
        stats = [r.stats or {} for r in ok]
        rounds = sum(s.get("rounds", 0) for s in stats)
        drafts = sum(s.get("drafts", 0) for s in stats)
        draft_tokens = sum(s.get("draft_tokens", 0) for s in stats)
        accepted = sum(s.get("accepted_tokens", 0) for s in stats)
        target_only_rounds = sum(s.get("target_only_rounds", 0) for s in stats)
        pipeline_hits = (
            sum(s.get("pipeline_hits", 0) for s in stats) if all("pipeline_hits" in s for s in stats) else None
        )
        hits_by_outcome = None
        if stats and all("pipeline_hits_by_outcome" in s for s in stats):
            hits_by_outcome = {}
            for s in stats:
                for outcome, n in s["pipeline_hits_by_outcome"].items():
                    hits_by_outcome[outcome] = hits_by_outcome.get(outcome, 0) + int(n)
        if mode.draft_length:  # fixed K: per-round draft sizes follow from the round sizes; check against the stats
            guess = [_drafted_for_fixed(r.round_tokens, mode.draft_length, max_new_tokens) for r in ok]
            if all(
                sum(g) == s.get("draft_tokens") and sum(1 for d in g if d > 0) == s.get("drafts")
                for g, s in zip(guess, stats)
            ):
                per_round_drafted = [d for g in guess for d in g]
        per_position_source = "stream"
        if stats and all("accepted_per_position" in s for s in stats):
            per_position_source = "stats"
    rec.update(
        rounds=rounds,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        target_only_rounds=target_only_rounds,
        pipeline_hits=pipeline_hits,
    )
    rec["pipeline_hit_rate"] = pipeline_hits / drafts if pipeline_hits is not None and drafts else None
    rec["pipeline_hits_by_outcome"] = (
        dict(sorted(hits_by_outcome.items(), key=_outcome_order)) if hits_by_outcome else None
    )
    rec["pipeline_hit_rate_by_outcome"] = (
        {o: n / drafts for o, n in rec["pipeline_hits_by_outcome"].items()} if hits_by_outcome and drafts else None
    )
    speculative = drafts > 0
    rec["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
    rec["acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    rec["mean_draft_length"] = draft_tokens / drafts if drafts else None
    # -- per position: rounds whose i-th draft token was accepted, / rounds that drafted (vLLM's definition)
    counts: list[int] = []
    if speculative:
        if per_position_source == "stats":
            for s in (r.stats or {} for r in ok):
                for i, v in enumerate(s["accepted_per_position"]):
                    counts.extend([0] * (i + 1 - len(counts)))
                    counts[i] += int(v)
        else:
            for a in accepted_rounds:
                counts.extend([0] * (a - len(counts)))
                for i in range(a):
                    counts[i] += 1
        # positions: a chain's K; a tree's depth (its mean draft length counts nodes, wider than deep)
        longest = mode.request.get("draft_length", 0) if tree else math.ceil(rec["mean_draft_length"] or 0)
        width = max(len(counts), longest, mode.draft_length or 0)
        counts.extend([0] * (width - len(counts)))
    rec["accepted_per_position"] = counts if speculative else None
    rec["acceptance_per_position"] = [c / drafts for c in counts] if speculative else None
    rec["pipeline_coverage_by_outcome"] = _coverage(rec["pipeline_hits_by_outcome"], counts, drafts)
    rec["per_position_source"] = per_position_source if speculative else None
    # -- theory: a, c, S(K), efficiency
    alpha = method = None
    chain = speculative and not tree  # a: a chain's per-token acceptance, not defined for a tree's node counts
    if chain and per_round_drafted is not None and len(per_round_drafted) == len(accepted_rounds):
        alpha, method = alpha_from_rounds(per_round_drafted, accepted_rounds), "rounds"
    elif chain:
        alpha, method = alpha_from_acceptance_length(rec["acceptance_length"], rec["mean_draft_length"]), "length"
    k = float(mode.draft_length) if mode.draft_length else rec["mean_draft_length"]
    c = (cost or {}).get("c")
    rec["alpha"], rec["alpha_method"] = alpha, method
    rec["cost_ratio"] = c if speculative else None
    rec["theoretical_speedup"] = rec["theoretical_model"] = None
    if speculative and alpha is not None and c:
        if mode.draft_length:  # fixed K: Leviathan's S(K)
            rec["theoretical_speedup"], rec["theoretical_model"] = theoretical_speedup(alpha, k, c), "S(K)"
        else:  # the mode picks K and may stop drafting: drafting rounds as S(K_mean), the others as target-only
            rec["theoretical_speedup"] = mixed_speedup(alpha, k, c, drafts, rounds)
            rec["theoretical_model"] = "mixed"
    verify_ms = ((cost or {}).get("target_verify_ms") or {}).get(str(mode.draft_length))
    rec["theoretical_speedup_measured_verify"] = (
        expected_tokens_per_round(alpha, k) / (k * c + verify_ms / cost["target_ms"])  # type: ignore[index]
        if speculative and alpha is not None and c and verify_ms
        else None
    )
    rec["efficiency"] = rec["efficiency_measured_verify"] = None
    # -- latencies (client side)
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    rec["ttft_ms_p50"] = _nan_none(percentile(ttft, 50))
    rec["ttft_ms_p99"] = _nan_none(percentile(ttft, 99))
    rec["itl_ms_p50"] = _nan_none(percentile(itl, 50))
    rec["itl_ms_p99"] = _nan_none(percentile(itl, 99))
    rec["greedy_identical"] = None
    rec["greedy_mismatches"] = []
    # Coordinator-side, from its overhead histogram (specd.tools.bench.overhead); set by the cells.
    rec["round_overhead_ms_p50"] = rec["round_overhead_ms_p99"] = None
    return rec


def _outcome_order(item: tuple[str, int]) -> tuple[int, str]:
    accepted, _, kind = item[0].partition(":")
    return (int(accepted) if accepted.isdigit() else 1 << 30, kind)


def _coverage(
    hits: Mapping[str, int] | None, accepted_per_position: Sequence[int], drafts: int
) -> dict[str, float] | None:
    """Per outcome 'j:kind': its hits / the rounds that accepted exactly j draft tokens (from the per-position counts).

    The share of such verdicts the pipeline had pre-drafted for; rounds with a
    shorter draft (a request's last ones) count at their own j."""
    if not hits or not drafts:
        return None
    reached = [drafts, *accepted_per_position, 0]  # reached[j]: rounds that accepted >= j
    out: dict[str, float] = {}
    for outcome, n in hits.items():
        j = int(outcome.partition(":")[0])
        exactly = reached[j] - reached[j + 1] if j + 1 < len(reached) else 0
        out[outcome] = n / exactly if exactly > 0 else float("nan")
    return out


def _nan_none(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def concurrency_table(
    records: Sequence[Mapping[str, Any]], temperature: float
) -> tuple[list[int], list[tuple[str, dict[int, float]]]]:
    """tokens/s per (services, mode) row and concurrency column, at one temperature."""
    cols = sorted({r["concurrency"] for r in records if r["temperature"] == temperature})
    rows: dict[str, dict[int, float]] = {}
    for r in records:
        if r["temperature"] == temperature and r["runner"] == RUNNER_SERVICE and r["tokens_per_s"] is not None:
            rows.setdefault(row_name(r), {})[r["concurrency"]] = r["tokens_per_s"]
    return cols, list(rows.items())


def batching_gains(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """batched / unbatched tokens/s for every (mode, T, clients) measured both ways."""
    by_key = {(r.get("services", ""), r["mode"], r["temperature"], r["concurrency"]): r for r in records}
    out = []
    for (label, mode, t, c), r in by_key.items():
        other = by_key.get(("unbatched", mode, t, c))
        if label == "batched" and other and r["tokens_per_s"] and other["tokens_per_s"]:
            out.append(
                {
                    "mode": mode,
                    "temperature": t,
                    "concurrency": c,
                    "batched_tokens_per_s": r["tokens_per_s"],
                    "unbatched_tokens_per_s": other["tokens_per_s"],
                    "gain": r["tokens_per_s"] / other["tokens_per_s"],
                }
            )
    return out


def row_name(r: Mapping[str, Any]) -> str:
    return f"{r['mode']} [{r['services']}]" if r.get("services") else r["mode"]
