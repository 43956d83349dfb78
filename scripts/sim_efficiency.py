#!/usr/bin/env python3
"""Efficiency and adaptivity on the emulated profiles (issue #16, item 5): a grid of `specd bench --sim` runs.

For every profile and draft agreement (the knob that sets acceptance, from a
useless draft at 0 to a near-perfect one) it runs one bench with target-only,
fixed-K for several K, the pipelined modes (pipelined-K, postverify-K and
speccache-K for --pipelined-lengths) and auto, side by side, at each
temperature, and reports per cell:

- each fixed K's speed-up and its efficiency at the measured verify cost
  (speed-up / S(K) with the measured K+1-token verify in S(K)'s denominator);
- the best fixed mode (any K, any pipeline) and auto's speed-up against it
  (auto / best fixed);
- auto against target-only (where the draft is useless it should be ~1);
- for both ratios, how far they could move with other prompts: the central 90% of a paired
  bootstrap over the prompts (specd.tools.bench.stats.paired_ratio_interval), the best fixed
  mode chosen again in every draw. At T > 0 the modes' texts differ (a pipeline uses the
  coins at other positions), so their acceptance differs by chance as well as by mode.

The best of a dozen noisy modes is flattered by its own noise (the winner's
curse): where its lead over auto is the luck of this run, the same mode run
again falls back. --confirm-prompts N runs a second bench per profile and
agreement, on other coins (--seed 1000) and N prompts: target-only, each
temperature's best fixed mode from the grid, and auto, side by side; the
cell's "confirmed" ratios (auto / that mode, auto / target-only, with their
paired intervals) come from that run alone, whose mode was chosen before it
ran.

Every figure is emulated (the services, batching and sampler are real; the
forward passes take the profile's modelled time).

    PYTHONPATH=$PWD .venv/bin/python scripts/sim_efficiency.py \\
        --profiles h100-tp2-70b,h100-8b --agreements 0,0.6,0.8,0.95 --temperatures 0,0.7 \\
        --draft-lengths 1,2,3,4,6 --pipelined-lengths 2,4 \\
        --json docs/results/emulated/efficiency.json --markdown docs/results/emulated/efficiency.md \\
        [--confirm-prompts 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure_args import floats, ints, names

from specd.tools.bench.stats import paired_ratio_interval


def bench(
    profile: str,
    agreement: float,
    args: argparse.Namespace,
    out: Path,
    *,
    modes: list[str] | None = None,
    prompts: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One `specd bench --sim` run of the grid's modes (or `modes`) for a profile and agreement; its records."""
    if modes is None:
        pipelined = [f"{m}-{k}" for m in ("pipelined", "postverify", "speccache") for k in args.pipelined_lengths]
        modes = ["target-only", *(f"fixed-{k}" for k in args.draft_lengths), *pipelined, *args.extra_modes, "auto"]
    lengths = {*args.draft_lengths, *args.pipelined_lengths, *(_draft_length(m) for m in modes)} - {None}
    cmd = [
        sys.executable,
        "-m",
        "specd.tools.entry",
        "bench",
        "--sim",
        f"{profile},agreement={agreement}",
        "--modes",
        ",".join(modes),
        "--draft-lengths",
        ",".join(str(k) for k in sorted(lengths)),
        "--concurrency",
        str(args.concurrency),
        "--temperatures",
        args.temperatures,
        "--prompts",
        str(prompts or args.prompts),
        "--seed",
        str(seed),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--interleave",
        str(args.interleave),
        "--no-progress",
        "--json",
        str(out),
    ]
    print(f"sim_efficiency: {profile} agreement {agreement}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["records"]


def _is_tree(mode: str) -> bool:
    """A tree mode's name: tree-N[xD], pipelined-tree-N[xD]."""
    return mode.startswith(("tree-", "pipelined-tree-"))


def _draft_length(mode: str) -> int | None:
    """K of a chain mode's name (fixed-3, speccache-2): None for target-only, auto and trees."""
    head, _, k = mode.rpartition("-")
    return int(k) if head and not _is_tree(mode) and k.isdigit() else None


def confirm(profile: str, agreement: float, rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """Auto against each row's best fixed mode again, in a run of their own (other coins, more prompts).

    Adds to each row: confirm_mode, confirm_prompts, confirm_best_speedup, confirm_auto_speedup (auto over
    target-only in that run; its interval confirm_auto_over_target_only_90) and confirm_auto_over_best (_90).
    """
    best = sorted({r["best_fixed"] for r in rows})
    records = bench(
        profile, agreement, args, out, modes=["target-only", *best, "auto"], prompts=args.confirm_prompts, seed=1000
    )
    for row in rows:
        by_mode = {r["mode"]: r for r in records if r["temperature"] == row["temperature"]}
        requests = {m: _requests(r) for m, r in by_mode.items()}
        mode, auto = row["best_fixed"], by_mode["auto"]["speedup"]
        row.update(
            confirm_mode=mode,
            confirm_prompts=args.confirm_prompts,
            confirm_best_speedup=by_mode[mode]["speedup"],
            confirm_auto_speedup=auto,
            confirm_auto_over_best=auto / by_mode[mode]["speedup"],
            confirm_auto_over_best_90=paired_ratio_interval(requests, "auto", [mode]),
            confirm_auto_over_target_only_90=paired_ratio_interval(requests, "auto", ["target-only"]),
        )
        if row["temperature"] == 0:
            row["greedy_differs"] = sorted(
                {*row["greedy_differs"], *(m for m, r in by_mode.items() if r.get("greedy_identical") is False)}
            )


def summarise(profile: str, agreement: float, temperature: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {r["mode"]: r for r in records if r["temperature"] == temperature}
    # every fixed chain: any K, any pipeline (trees are not among auto's arms: compared on their own)
    fixed = {m: r for m, r in by_mode.items() if m not in ("target-only", "auto") and not _is_tree(m)}
    trees = {m: r for m, r in by_mode.items() if _is_tree(m)}
    best_mode = max(fixed, key=lambda m: fixed[m]["speedup"])
    best_tree = max(trees, key=lambda m: trees[m]["speedup"]) if trees else None
    plain = [m for m in fixed if m.startswith("fixed-")]
    best_plain = max(plain, key=lambda m: fixed[m]["speedup"]) if plain else best_mode
    auto = by_mode["auto"]
    requests = {m: _requests(r) for m, r in by_mode.items()}
    tree_figures: dict[str, Any] = {}
    if best_tree is not None:
        tree_figures = {
            "best_tree": best_tree,
            "best_tree_speedup": trees[best_tree]["speedup"],
            "tree_over_best_chain": trees[best_tree]["speedup"] / fixed[best_mode]["speedup"],
            # against the chains without a pipeline too (unpipelined trees' like-for-like)
            "best_unpipelined_chain": best_plain,
            "tree_over_unpipelined_chain": trees[best_tree]["speedup"] / fixed[best_plain]["speedup"],
        }
    return {
        **tree_figures,
        "profile": profile,
        "agreement": agreement,
        "temperature": temperature,
        "acceptance_rate": {m: r.get("acceptance_rate") for m, r in fixed.items()},
        "alpha": by_mode[best_mode].get("alpha"),
        "speedup": {m: r["speedup"] for m, r in by_mode.items()},
        "efficiency_measured_verify": {m: r.get("efficiency_measured_verify") for m, r in fixed.items()},
        "best_fixed": best_mode,
        "best_fixed_speedup": fixed[best_mode]["speedup"],
        "auto_speedup": auto["speedup"],
        "auto_over_best_fixed": auto["speedup"] / fixed[best_mode]["speedup"],
        "auto_over_best_fixed_90": paired_ratio_interval(requests, "auto", list(fixed)),
        "auto_over_target_only_90": paired_ratio_interval(requests, "auto", ["target-only"]),
        "auto_mean_draft_length": auto.get("mean_draft_length"),
        "overhead_ms_p50": {m: r.get("round_overhead_ms_p50") for m, r in by_mode.items()},
        # T = 0: the modes whose greedy output was not target-only's, token for token (should be none)
        "greedy_differs": sorted(m for m, r in by_mode.items() if r.get("greedy_identical") is False),
    }


def _requests(record: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """A record's requests as prompt id -> (tokens, seconds); a prompt that ran twice is told apart by its turn."""
    out: dict[str, tuple[float, float]] = {}
    for r in record.get("per_request") or []:
        key, turn = r["prompt_id"], 1
        while key in out:
            key, turn = f"{r['prompt_id']}#{turn}", turn + 1
        out[key] = (float(r["tokens"]), float(r["seconds"]))
    return out


def _interval(bounds: list[float] | tuple[float, float] | None) -> str:
    return f" [{bounds[0]:.2f}, {bounds[1]:.2f}]" if bounds else ""


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    ks = [f"fixed-{k}" for k in args.draft_lengths]
    pipelined = [f"{m}-{k}" for m in ("pipelined", "postverify", "speccache") for k in args.pipelined_lengths]
    pipelined += args.extra_modes
    out = [
        "# Efficiency and auto on emulated accelerators (issues #16 and #30)",
        "",
        "**Emulated**: the services, batching, sessions and sampler are real; the models' logits and "
        "forward-pass times come from each profile (docs/performance.md). Every figure below is emulated.",
        "",
        f"`{' '.join(sys.argv)}` ({seconds:.0f} s). T = {args.temperatures}, {args.concurrency} client(s), "
        f"{args.prompts} prompts x {args.max_new_tokens} tokens per mode, interleave {args.interleave}.",
        "",
        "Speed-up against target-only in the same run; efficiency = speed-up / S(K) with the measured "
        "verify cost (docs/bench.md). In brackets: the central 90% of a paired bootstrap over the prompts "
        "(the best fixed mode chosen again in each draw).",
        "",
        "| profile | agreement | T | a | "
        + " | ".join(f"{k} speed-up (eff.)" for k in ks)
        + " | "
        + " | ".join(pipelined)
        + " | best fixed | auto | auto / best fixed | auto / target-only | auto mean K |"
        + (" best tree / best fixed (any pipeline) / best fixed-K |" if args.extra_modes else ""),
        "|---|---|---|---|"
        + "---|" * (len(ks) + len(pipelined))
        + "---|---|---|---|---|"
        + ("---|" if args.extra_modes else ""),
    ]
    for r in rows:
        cells = []
        for k in ks:
            eff = r["efficiency_measured_verify"].get(k)
            cells.append(f"{r['speedup'][k]:.2f}x ({eff:.2f})" if eff is not None else f"{r['speedup'][k]:.2f}x")
        cells += [f"{r['speedup'][m]:.2f}x" for m in pipelined]
        alpha = f"{r['alpha']:.2f}" if r["alpha"] is not None else "–"
        mean_k = f"{r['auto_mean_draft_length']:.1f}" if r["auto_mean_draft_length"] is not None else "–"
        out.append(
            f"| {r['profile']} | {r['agreement']} | {r['temperature']:g} | {alpha} | "
            + " | ".join(cells)
            + f" | `{r['best_fixed']}` {r['best_fixed_speedup']:.2f}x | {r['auto_speedup']:.2f}x | "
            f"{r['auto_over_best_fixed']:.3f}{_interval(r.get('auto_over_best_fixed_90'))} | "
            f"{r['auto_speedup']:.3f}{_interval(r.get('auto_over_target_only_90'))} | {mean_k} |"
            + (
                f" `{r['best_tree']}` {r['best_tree_speedup']:.2f}x / {r['tree_over_best_chain']:.3f} / "
                f"{r['tree_over_unpipelined_chain']:.3f} (`{r['best_unpipelined_chain']}`) |"
                if "best_tree" in r
                else ""
            )
        )
    confirmed = [r for r in rows if "confirm_mode" in r]
    if confirmed:
        out += [
            "",
            f"**Confirmed** in a run of their own per profile and agreement ({confirmed[0]['confirm_prompts']} prompts, "
            "other coins: `--seed 1000`): target-only, each cell's best fixed mode from the table above (chosen "
            "before this run, so its lead is not its own noise), and auto, side by side.",
            "",
            "| profile | agreement | T | best fixed (from the grid) | its speed-up | auto | auto / best fixed "
            "| auto / target-only |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in confirmed:
            out.append(
                f"| {r['profile']} | {r['agreement']} | {r['temperature']:g} | `{r['confirm_mode']}` | "
                f"{r['confirm_best_speedup']:.2f}x | {r['confirm_auto_speedup']:.2f}x | "
                f"{r['confirm_auto_over_best']:.3f}{_interval(r['confirm_auto_over_best_90'])} | "
                f"{r['confirm_auto_speedup']:.3f}{_interval(r['confirm_auto_over_target_only_90'])} |"
            )
    greedy = [r for r in rows if r["temperature"] == 0]
    differs = [
        f"{r['profile']} {r['agreement']}: {', '.join(r['greedy_differs'])}" for r in greedy if r["greedy_differs"]
    ]
    if greedy:
        out += [
            "",
            "Greedy output differs from target-only's in " + "; ".join(differs) + "."
            if differs
            else "Greedy output equals target-only's in every T = 0 cell (every mode's `greedy_identical`).",
        ]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="h100-tp2-70b,h100-8b")
    ap.add_argument("--agreements", default="0,0.5,0.7,0.85,0.95")
    ap.add_argument("--draft-lengths", default="1,2,3,4,6,8")
    ap.add_argument("--pipelined-lengths", default="2,4", help="K of the pipelined, postverify and speccache modes")
    ap.add_argument("--temperatures", default="0", help="comma-separated; one bench runs them all")
    ap.add_argument("--extra-modes", default="", help="more modes to run beside them (e.g. tree-8,tree-16)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--interleave", type=int, default=2)
    ap.add_argument(
        "--confirm-prompts",
        type=int,
        default=0,
        help="run auto against each cell's best fixed mode again on N prompts and other coins (0: no)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    args = ap.parse_args()
    args.draft_lengths = ints(args.draft_lengths)
    args.pipelined_lengths = ints(args.pipelined_lengths) if args.pipelined_lengths else []
    args.extra_modes = names(args.extra_modes) if args.extra_modes else []
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="specd-efficiency-") as tmp:
        for profile in names(args.profiles):
            for agreement in floats(args.agreements):
                records = bench(profile, agreement, args, Path(tmp) / f"{profile}-{agreement}.json")
                cell = [summarise(profile, agreement, t, records) for t in floats(args.temperatures)]
                if args.confirm_prompts > 0:
                    confirm(profile, agreement, cell, args, Path(tmp) / f"{profile}-{agreement}-confirm.json")
                for row in cell:
                    rows.append(row)
                    print(
                        json.dumps(
                            {
                                k: rows[-1][k]
                                for k in (
                                    "profile",
                                    "agreement",
                                    "temperature",
                                    "best_fixed",
                                    "best_fixed_speedup",
                                    "auto_speedup",
                                    "auto_over_best_fixed",
                                    "auto_over_best_fixed_90",
                                    "tree_over_best_chain",
                                    "tree_over_unpipelined_chain",
                                    "confirm_auto_over_best",
                                    "confirm_auto_over_best_90",
                                    "confirm_auto_speedup",
                                )
                                if k in rows[-1]
                            }
                        ),
                        flush=True,
                    )
    text = markdown(rows, args, time.monotonic() - started)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
