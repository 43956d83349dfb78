"""`specd bench` flags (stdlib and the bench's pure modules only: the CLI builds every parser at start)."""

from __future__ import annotations

import argparse

from specd.tools.bench.modes import DEFAULT_MODES
from specd.tools.bench.plan import BATCHING_SETUPS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specd bench` flags (no heavy imports: the CLI builds every parser at start)."""
    g = p.add_argument_group("services")
    g.add_argument("--target", default="demo", help="target model folder or 'demo' (default: demo)")
    g.add_argument(
        "--draft",
        default="demo",
        help="draft model folder, 'demo', 'ngram', 'suffix' or 'suffix+MODEL' (suffix and suffix+MODEL learn "
        "across requests: each mode gets a fresh draft service and runs its requests in sequence) (default: demo)",
    )
    g.add_argument(
        "--address",
        default="",
        help="use running services at this coordinator HOST:PORT "
        "(--target/--draft then name the same models, for the tokenizer, c and the HF baseline)",
    )
    g.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    g.add_argument(
        "--target-threads",
        type=int,
        default=0,
        help="torch threads of the target service (default 0: the services' own default, up to the CPUs available, "
        "fewer while other processes take them)",
    )
    g.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft service (default: 1)")
    g.add_argument(
        "--hf-threads",
        type=int,
        default=0,
        help="torch threads of the in-process HF baseline and of the bench process (default: the target service's)",
    )
    for svc in ("target", "draft", "coordinator"):
        g.add_argument(f"--{svc}-args", default="", help=f"extra flags for `specd serve {svc}` (one string)")
    g = p.add_argument_group("emulated accelerators")
    g.add_argument(
        "--sim",
        default="",
        metavar="PROFILE",
        help="run both model services on an emulated accelerator profile (sim:PROFILE; overrides after commas, "
        "e.g. h100-tp2-70b,agreement=0.7); default modes target-only,fixed,pipelined,postverify,auto; "
        "every table and plot says 'emulated' (docs/performance.md)",
    )
    g.add_argument(
        "--list-sim-profiles", action="store_true", help="print the shipped emulated-accelerator profiles and exit"
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--quick",
        action="store_true",
        help="small preset: 6 prompts, 32 tokens, K=4 (T 0 and 0.7, 1 and 8 clients); explicit flags still win",
    )
    g.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="comma list: target-only, auto, fixed-K (bare 'fixed': "
        "every --draft-lengths K), tree-N / tree-NxD (trees of N nodes, D levels deep, docs/trees.md), hf-K / hf (the HF baseline, K assistant tokens, constant), hf-default, "
        f"hf-target-only (default: {DEFAULT_MODES})",
    )
    g.add_argument(
        "--custom-mode",
        action="append",
        default=[],
        metavar="NAME:key=value,...",
        help="an extra service mode from request options, e.g. 'pipe-4:speculation=fixed,draft_length=4,"
        "pipeline=bonus' (repeatable)",
    )
    g.add_argument(
        "--draft-lengths", default=None, help="K values for fixed/pipelined/hf, e.g. 2,4,8 for a sweep (default: 4)"
    )
    g.add_argument("--temperatures", default=None, help="comma list (default: 0,0.7)")
    g.add_argument(
        "--concurrency", default=None, help="concurrent clients, comma list (default: 1,8); the HF baseline runs at 1"
    )
    g.add_argument(
        "--prompts", type=int, default=None, help="prompts per cell, mixed over categories (default: 30; quick: 6)"
    )
    g.add_argument(
        "--warm-requests",
        type=int,
        default=0,
        help="each mode's first N requests run first and stay out of its record (the steady state after "
        "warm-up); the warm-up curve shows every request (default: 0)",
    )
    g.add_argument(
        "--prompt-file",
        default="",
        help="JSONL prompt set, or a shipped one by name: 'bench' (default: "
        "code, chat, prose), 'edit' (repetition-heavy: edit the code in the prompt, for --draft ngram) or "
        "'repetitive' (tool calls, SQL, code review that repeat their structure across requests, for --draft suffix)",
    )
    g.add_argument("--categories", default="", help="only these categories, comma list (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default: 64; quick: 32)")
    g.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at end-of-sequence (default: generate exactly --max-new-tokens, for equal work in every mode)",
    )
    g.add_argument("--seed", type=int, default=0, help="request i gets seed + i (default: 0)")
    g.add_argument("--cost-samples", type=int, default=None, help="forwards timed per model for c (default: 30)")
    g.add_argument(
        "--no-inprocess",
        action="store_true",
        help="skip everything that loads the models in this "
        "process: the HF baseline and the measured c (S(K) then stays empty)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    g.add_argument(
        "--batching",
        choices=sorted(BATCHING_SETUPS),
        default="on",
        help="'both' runs every cell twice, on services with batched forward passes and on the same "
        "services with --max-batch 1, and reports the gain; 'off' only the latter (default: on)",
    )
    g.add_argument(
        "--tracing-overhead",
        action="store_true",
        help="also measure tracing's cost: services trace 100%% of requests to an OTLP receiver in "
        "this process; traced and untraced requests alternate (see docs/bench.md)",
    )
    g.add_argument(
        "--tracing-mode",
        default="",
        help="mode for --tracing-overhead (default: the first speculative service mode, else target-only)",
    )
    g.add_argument(
        "--tracing-repeats",
        type=int,
        default=2,
        help="passes over the prompts per variant for --tracing-overhead (default: 2)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", default="", help="JSON report (default: bench-results/bench.json)")
    g.add_argument("--markdown", default="", help="markdown table (default: next to the JSON, .md)")
    g.add_argument("--plot", default="", help="PNG plot (default: next to the JSON, .png)")
    g.add_argument("--save-outputs", action="store_true", help="include every request's token IDs in the JSON")
    g.add_argument(
        "--interleave",
        type=int,
        default=1,
        help="modes take turns over N slices of the prompts (each of at least `clients` prompts), so a "
        "shared machine's drifts hit every mode alike (default: 1, each mode runs the whole set)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if a specd mode's greedy output differs from target-only's or a request failed",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--verbose", action="store_true", help="relay the services' log lines")
