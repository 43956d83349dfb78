"""The markdown report of a run (docs/bench.md defines every number in it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from specd.tools.bench.records import concurrency_table, row_name


def _fmt(x: Any, digits: int = 2, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def _threads(n: int, emulated: bool) -> str:
    """A service's --torch-threads as the report says it: 0 is the governed default (an emulated model: 1)."""
    if n:
        return str(n)
    return "1 (emulated model)" if emulated else "0 (up to the CPUs available, fewer while other processes take them)"


def _openmp(machine: Mapping[str, Any]) -> str:
    """The OpenMP runtime and the wait settings the environment gave it (older reports have none)."""
    omp = machine.get("openmp")
    if not omp:
        return "OpenMP settings not recorded"
    waits = ", ".join(f"{k}={v}" for k, v in omp.items() if k != "openmp") or "its default wait policy"
    return f"OpenMP {omp.get('openmp', 'unknown')}, {waits}"


def render_markdown(report: Mapping[str, Any]) -> str:
    meta, records = report["meta"], report["records"]
    s = meta["settings"]
    piped = any(r["request"].get("pipeline") not in (None, False, "off") for r in records)
    emu = meta.get("emulated")
    overhead = any(r.get("round_overhead_ms_p50") is not None for r in records)
    lines = [
        "# specd bench" + (f" (emulated: {emu['profile']})" if emu else ""),
        "",
        *(
            [
                f"**Emulated accelerators** (`{emu['spec']}`, docs/performance.md): target {emu['target']['model']} "
                f"on {emu['target']['hardware']}, draft {emu['draft']['model']} on {emu['draft']['hardware']}; "
                "the services, batching, sessions and sampler are real, the models' logits and forward-pass "
                "times come from the profile. Every figure below is emulated.",
                "",
            ]
            if emu
            else []
        ),
        f"Target `{meta['models']['target']}`, draft `{meta['models']['draft']}`; {s['prompts']} prompts "
        f"({', '.join(s['categories'])}), {s['max_new_tokens']} new tokens each"
        f"{'' if s['stop_at_eos'] else ' (past end-of-sequence)'}; threads target {_threads(s['target_threads'], bool(emu))}, "
        f"draft {_threads(s['draft_threads'], bool(emu))}, HF baseline {s['hf_threads']}; {meta['machine']['cpus']} CPUs; "
        f"{_openmp(meta['machine'])}; {meta['duration_s']:.0f} s."
        + (
            f" Modes interleaved over up to {s['interleave']} slices of the prompts per cell."
            if s.get("interleave", 1) > 1
            else ""
        ),
        "",
        *(["**Interrupted: partial results.**", ""] if meta.get("interrupted") else []),
        "| T | clients | mode | tok/s | speed-up | acc. rate | acc. length | a | c | S(K) | efficiency "
        "| S(K) at measured verify | efficiency at measured verify "
        "| TTFT p50 ms | ITL p50 ms | ITL p99 ms | greedy = target-only | errors |"
        + (" pipeline hits |" if piped else "")
        + (" overhead p50 ms | overhead p99 ms |" if overhead else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if piped else "")
        + ("---|---|" if overhead else ""),
    ]
    for r in records:
        lines.append(
            "| "
            + " | ".join(
                [
                    _fmt(r["temperature"], 1),
                    str(r["concurrency"]),
                    f"`{row_name(r)}`",
                    _fmt(r["tokens_per_s"], 1),
                    _fmt(r["speedup"], 2, "x"),
                    _fmt(r["acceptance_rate"], 3),
                    _fmt(r["acceptance_length"]),
                    _fmt(r["alpha"], 3),
                    _fmt(r["cost_ratio"], 3),
                    _fmt(r["theoretical_speedup"], 2, "x"),
                    _fmt(r["efficiency"]),
                    _fmt(r.get("theoretical_speedup_measured_verify"), 2, "x"),
                    _fmt(r.get("efficiency_measured_verify")),
                    _fmt(r["ttft_ms_p50"], 1),
                    _fmt(r["itl_ms_p50"], 1),
                    _fmt(r["itl_ms_p99"], 1),
                    _fmt(r["greedy_identical"]),
                    str(r["errors"]),
                    *([_fmt(r.get("pipeline_hit_rate"))] if piped else []),
                    *([_fmt(r.get("round_overhead_ms_p50")), _fmt(r.get("round_overhead_ms_p99"))] if overhead else []),
                ]
            )
            + " |"
        )
    fallback = [r for r in records if r.get("target_only_rounds")]
    for r in fallback:
        lines += [
            "",
            f"Note: `{row_name(r)}` at T={r['temperature']:g}, {r['concurrency']} client(s) ran "
            f"{r['target_only_rounds']} rounds without draft tokens (the drafter proposed nothing, e.g. an "
            "n-gram drafter without a match, or the draft was unavailable, slow or incompatible): its "
            "numbers mix in target-only decoding.",
        ]
    spec = [r for r in records if r["acceptance_per_position"]]
    if spec:
        width = max(len(r["acceptance_per_position"]) for r in spec)
        lines += [
            "",
            "Acceptance per draft position (rounds whose i-th draft token was accepted / rounds that drafted):",
            "",
            "| T | clients | mode | " + " | ".join(str(i + 1) for i in range(width)) + " |",
            "|---|---|---|" + "---|" * width,
        ]
        for r in spec:
            cells = [_fmt(x) for x in r["acceptance_per_position"]] + [""] * (width - len(r["acceptance_per_position"]))
            lines.append(
                f"| {_fmt(r['temperature'], 1)} | {r['concurrency']} | `{row_name(r)}` | " + " | ".join(cells) + " |"
            )
    by_outcome = [r for r in records if r.get("pipeline_hit_rate_by_outcome")]
    if by_outcome:
        outcomes = sorted(
            {o for r in by_outcome for o in r["pipeline_hit_rate_by_outcome"]},
            key=lambda o: (int(o.partition(":")[0]), o.partition(":")[2]),
        )
        lines += [
            "",
            "Pipeline hits by the verdict they were pre-drafted for (`accepted:kind`): hits / drafts, and in "
            "brackets hits / rounds that accepted that many (the share of those verdicts covered):",
            "",
            "| T | clients | mode | " + " | ".join(f"`{o}`" for o in outcomes) + " |",
            "|---|---|---|" + "---|" * len(outcomes),
        ]
        for r in by_outcome:
            rate, cover = r["pipeline_hit_rate_by_outcome"], r.get("pipeline_coverage_by_outcome") or {}
            cells = [f"{_fmt(rate[o])} ({_fmt(cover.get(o))})" if o in rate else "" for o in outcomes]
            lines.append(
                f"| {_fmt(r['temperature'], 1)} | {r['concurrency']} | `{row_name(r)}` | " + " | ".join(cells) + " |"
            )
    temps = list(dict.fromkeys(r["temperature"] for r in records))
    for t in temps:
        cols, rows = concurrency_table(records, t)
        if len(cols) > 1:
            lines += [
                "",
                f"Tokens/s against concurrent clients (T={t:g}):",
                "",
                "| mode | " + " | ".join(str(c) for c in cols) + " |",
                "|---|" + "---|" * len(cols),
            ]
            for name, by_c in rows:
                lines.append(f"| `{name}` | " + " | ".join(_fmt(by_c.get(c), 1) for c in cols) + " |")
    curves = [r for r in records if r.get("warmup_curve") and r["mode"] != "target-only"]
    if curves and (s.get("warm_requests") or s.get("learning_draft")):
        groups = [g["requests"] for g in curves[0]["warmup_curve"]]
        lines += [
            "",
            "Warm-up curve: speed-up over target-only by request index (requests in the order they ran"
            + (f"; the first {s['warm_requests']} are not in the records above" if s.get("warm_requests") else "")
            + "), acceptance rate in brackets:",
            "",
            "| T | clients | mode | " + " | ".join(groups) + " |",
            "|---|---|---|" + "---|" * len(groups),
        ]
        for r in curves:
            cells = [f"{_fmt(g['speedup'], 2, 'x')} ({_fmt(g['acceptance_rate'], 2)})" for g in r["warmup_curve"]]
            lines.append(
                f"| {_fmt(r['temperature'], 1)} | {r['concurrency']} | `{row_name(r)}` | " + " | ".join(cells) + " |"
            )
    gains = meta.get("batching_gains") or []
    if gains:
        lines += [
            "",
            "Batching: tokens/s with batched forward passes / the same services with --max-batch 1:",
            "",
            "| T | clients | mode | batched tok/s | unbatched tok/s | gain |",
            "|---|---|---|---|---|---|",
        ]
        for g in gains:
            lines.append(
                f"| {_fmt(g['temperature'], 1)} | {g['concurrency']} | `{g['mode']}` | "
                f"{_fmt(g['batched_tokens_per_s'], 1)} | {_fmt(g['unbatched_tokens_per_s'], 1)} | "
                f"{_fmt(g['gain'], 2, 'x')} |"
            )
    tro = meta.get("tracing_overhead")
    if tro:
        lines += [
            "",
            f"Tracing overhead (`{tro['mode']}`, T=0, 1 client, {tro['requests_per_variant']} requests each, "
            f"interleaved; {tro['spans_received']} spans received by the OTLP sink): traced "
            f"{_fmt(tro['tokens_per_s_on'], 2)} tok/s vs untraced {_fmt(tro['tokens_per_s_off'], 2)} tok/s, "
            f"**{_fmt(tro['overhead_pct'], 2)}% fewer tokens/s** with 100% sampling.",
        ]
    cost = meta.get("cost") or {}
    if cost.get("service"):
        c = cost["service"]
        verify = ", ".join(f"K={k}: {v:.2f} ms" for k, v in c["target_verify_ms"].items())
        if c.get("source"):  # not measured: e.g. an emulated profile's cost model
            lines += [
                "",
                f"Cost ({c['source']}): target {c['target_ms']:.2f} ms per 1-token forward, draft "
                f"{c['draft_ms']:.2f} ms per token, **c = {c['c']:.3f}**; target verify over K+1 tokens: {verify}.",
            ]
        else:
            lines += [
                "",
                f"Cost (in-process, median of {c['samples']}): target {c['target_ms']:.2f} ms per 1-token "
                f"forward ({c['target_threads']} threads), draft {c['draft_ms']:.2f} ms per token "
                f"({c['draft_threads']} threads), **c = {c['c']:.3f}**; target verify over K+1 tokens: {verify}.",
            ]
    if cost.get("hf"):
        c = cost["hf"]
        lines += [f"Peer cost ({c['target_threads']} threads for both): c = {c['c']:.3f}."]
    rss = meta.get("peak_rss_mb") or {}
    if rss:
        lines += ["", "Peak RSS (VmHWM): " + ", ".join(f"{k} {_fmt(v, 0, ' MB')}" for k, v in rss.items()) + "."]
    corr = meta.get("correctness") or {}
    if corr.get("reference"):
        verdict = "identical" if corr["identical"] else "**NOT identical**"
        hf_baseline = (
            ""
            if corr.get("peer_identical") in (None, True)
            else " The HF baseline's output differs (reported, not ours)."
        )
        lines += [
            "",
            f"Greedy check: every specd mode's temperature-0 output is {verdict} to "
            f"{corr['reference']} ({corr['records_checked']} records checked).{hf_baseline}",
        ]
    lines += [
        "",
        "Definitions: docs/bench.md. tok/s = completion tokens of the cell / its wall time; speed-up = "
        "tok/s / target-only's in the same (T, clients) cell; a = per-token acceptance; S(K) = "
        "(1 - a^(K+1)) / ((1 - a)(K c + 1)); efficiency = speed-up / S(K); 'at measured verify' puts the "
        "measured cost of the target's K+1-token pass, v_K, in place of S(K)'s 1: "
        "(1 - a^(K+1)) / ((1 - a)(K c + v_K))."
        + (
            " overhead = the coordinator's round wall time minus draft and target compute, p50 / p99 from its "
            "specd:round_seconds{part=overhead} histogram (interpolated within buckets)."
            if overhead
            else ""
        ),
        "",
    ]
    return "\n".join(lines)
