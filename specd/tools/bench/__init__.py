"""`specd bench`: every decoding mode side by side, in one run, on the same services and prompts.

    specd bench --quick                          # demo pair, small grid, a few minutes
    specd bench --json out/bench.json            # full grid: T 0 and 0.7, 1 and 8 clients, K 4
    specd bench --address HOST:PORT --target DIR --draft DIR   # services already running

What a run does:

1. starts target, draft and coordinator as processes (specd.tools.localcluster), or
   connects to running ones (--address);
2. measures the cost ratio c in-process: draft time per token / target time
   per forward (one token with a warm KV cache, median of N);
3. for each cell (temperature x concurrent clients), runs the shipped prompt
   set through every mode: `target-only` (the baseline: speculation off,
   through the same services), `fixed-K`, `auto`, ... over the Coordinator
   API (streaming, timed per message), and the HF baseline, Hugging Face
   transformers' assisted generation, in this process on the same pair;
4. checks that every mode's greedy (T = 0) output equals target-only's;
5. writes JSON (one record per mode x temperature x concurrency), a
   markdown table and a PNG plot.

Modes are data (`Mode`: a name, a runner, request options). A new request
option becomes a mode by adding one line to SERVICE_MODES or
SERVICE_FAMILIES (bench/modes.py), or without any code change with
``--custom-mode 'NAME:key=value,...'`` (the keys are CoordinatorClient
request options). docs/bench.md defines every reported number.

The package, one concern per module: modes, prompts, results (one request),
services (the specd runner), the HF baseline (transformers' assisted generation), cost
(c), stats (a, S(K)), records (one record per cell), compare (speed-up and the
greedy check), report / plot / output (the files), plan / args (flags),
cells (the measured cells), learning (drafters that learn across requests:
a fresh draft per mode, the warm-up curve), prepare, tracing, main (the run).

Importing the package stays cheap (stdlib and the pure modules only): the CLI
imports it to build its parser. `run` loads the services' client, torch and
transformers on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specd.tools.bench.args import add_arguments
from specd.tools.bench.compare import finish_records
from specd.tools.bench.modes import (
    BASELINE,
    DEFAULT_MODES,
    HF_DEFAULT,
    HF_LOOKUP,
    HF_TARGET_ONLY,
    RUNNER_HF,
    RUNNER_SERVICE,
    SERVICE_FAMILIES,
    SERVICE_MODES,
    Mode,
    cap_adaptive_modes,
    largest_k,
    parse_custom_mode,
    parse_modes,
)
from specd.tools.bench.plan import BATCHING_SETUPS, BenchError, ServiceSetup, interleave_slices
from specd.tools.bench.prompts import (
    BenchPrompt,
    default_prompt_file,
    load_prompts,
    select_prompts,
    shipped_prompt_file,
    tokenize_prompt,
)
from specd.tools.bench.records import batching_gains, concurrency_table, summarize
from specd.tools.bench.report import render_markdown
from specd.tools.bench.results import RequestResult
from specd.tools.bench.stats import (
    alpha_from_acceptance_length,
    alpha_from_rounds,
    expected_tokens_per_round,
    mixed_speedup,
    paired_ratio_interval,
    percentile,
    theoretical_speedup,
)

if TYPE_CHECKING:
    from specd.tools.bench.main import run

__all__ = [
    "BASELINE",
    "BATCHING_SETUPS",
    "DEFAULT_MODES",
    "HF_DEFAULT",
    "HF_LOOKUP",
    "HF_TARGET_ONLY",
    "RUNNER_HF",
    "RUNNER_SERVICE",
    "SERVICE_FAMILIES",
    "SERVICE_MODES",
    "BenchError",
    "BenchPrompt",
    "Mode",
    "RequestResult",
    "ServiceSetup",
    "add_arguments",
    "alpha_from_acceptance_length",
    "alpha_from_rounds",
    "batching_gains",
    "cap_adaptive_modes",
    "concurrency_table",
    "default_prompt_file",
    "expected_tokens_per_round",
    "finish_records",
    "interleave_slices",
    "largest_k",
    "load_prompts",
    "mixed_speedup",
    "paired_ratio_interval",
    "parse_custom_mode",
    "parse_modes",
    "percentile",
    "render_markdown",
    "run",
    "select_prompts",
    "shipped_prompt_file",
    "summarize",
    "theoretical_speedup",
    "tokenize_prompt",
]


def __getattr__(name: str) -> Any:
    """`specd.tools.bench.run`, loaded on first use (PEP 562): it needs torch, transformers and gRPC."""
    if name == "run":
        from specd.tools.bench.main import run as main_run  # noqa: PLC0415 - PEP 562: the package stays cheap to import

        return main_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
