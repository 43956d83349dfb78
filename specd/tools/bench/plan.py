"""A run's plan: flags (with the --quick and full presets) turned into modes, cells, prompts and slices."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.serving.cpu_budget import service_threads
from specd.tools.bench.modes import Mode, cap_adaptive_modes, parse_modes
from specd.tools.bench.prompts import BenchPrompt, load_prompts, select_prompts

# --draft values that load no draft model (catalog.MODEL_FREE_DRAFTS), and the ones that learn
# across requests (catalog.SUFFIX, catalog.HYBRID_PREFIX): spelled here because the catalog imports
# torch, and the CLI builds this parser at every start (tests/unit/tools/test_suffix_bench.py checks they agree).
MODEL_FREE_DRAFTS = ("ngram", "suffix")
HYBRID_PREFIX = "suffix+"


def learns_across_requests(draft: str) -> bool:
    """Whether a --draft value keeps state across requests (the suffix drafter's learned indexes)."""
    return draft == "suffix" or (draft.startswith(HYBRID_PREFIX) and len(draft) > len(HYBRID_PREFIX))


class BenchError(Exception):
    """A problem with the run's set-up (reported in one line, exit status 2)."""


@dataclass(frozen=True)
class ServiceSetup:
    """One way of starting the services; a run compares set-ups side by side (e.g. batching on / off)."""

    label: str  # "" when the run has a single set-up
    model_service_args: tuple[str, ...] = ()  # added to the draft's and the target's flags


BATCHING_SETUPS = {
    "on": [ServiceSetup("")],  # the services' default (--max-batch 32)
    "off": [ServiceSetup("unbatched", ("--max-batch", "1"))],
    "both": [ServiceSetup("batched"), ServiceSetup("unbatched", ("--max-batch", "1"))],
}


FULL_DEFAULTS = dict(
    prompts=30, max_new_tokens=64, draft_lengths="4", temperatures="0,0.7", concurrency="1,8", cost_samples=30
)
QUICK_DEFAULTS = dict(
    prompts=6, max_new_tokens=32, draft_lengths="4", temperatures="0,0.7", concurrency="1,8", cost_samples=10
)


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers (got {text!r})") from None
    if not out or min(out) < 1:
        raise ValueError(f"{what} must list integers >= 1 (got {text!r})")
    return out


def _float_list(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of numbers (got {text!r})") from None
    if not out or min(out) < 0:
        raise ValueError(f"{what} must list numbers >= 0 (got {text!r})")
    return out


@dataclass
class Plan:
    modes: list[Mode]
    temperatures: list[float]
    concurrency: list[int]
    draft_lengths: list[int]
    prompts: list[BenchPrompt]
    max_new_tokens: int
    cost_samples: int
    hf_threads: int
    warm_requests: int = 0  # each mode's first requests, run but kept out of its record


def make_plan(args: argparse.Namespace) -> Plan:
    preset = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return preset[name] if value is None else value

    draft_lengths = _int_list(pick("draft_lengths"), "--draft-lengths")
    modes = cap_adaptive_modes(parse_modes(args.modes, draft_lengths, args.custom_mode), draft_lengths)
    if args.no_inprocess or args.draft in MODEL_FREE_DRAFTS:
        modes = [
            m for m in modes if not m.hf_baseline or (not m.request.get("assistant", True) and not args.no_inprocess)
        ]
    prompts_n, max_new = int(pick("prompts")), int(pick("max_new_tokens"))
    if prompts_n < 1 or max_new < 1:
        raise ValueError("--prompts and --max-new-tokens must be >= 1")
    if args.interleave < 1:
        raise ValueError(f"--interleave must be >= 1 (got {args.interleave})")
    learning = learns_across_requests(args.draft)
    drafting = [m.name for m in modes if not m.hf_baseline and m.request.get("speculation") != "off"]
    if learning and args.interleave > 1 and len(drafting) > 1:
        # Target-only requests never reach the draft: one drafting mode may take turns with them, its
        # index learning from its own requests only. Two would learn from each other's outputs.
        raise ValueError(
            f"--draft {args.draft} learns across requests: with --interleave, run one drafting mode at a time "
            f"(got {', '.join(drafting)})"
        )
    concurrency = args.concurrency if args.concurrency is not None or not learning else "1"
    if not 0 <= args.warm_requests < prompts_n:
        raise ValueError(f"--warm-requests must be in 0..{prompts_n - 1} (got {args.warm_requests})")
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = select_prompts(load_prompts(args.prompt_file or None), prompts_n, categories)
    if not prompts:
        raise ValueError(f"no prompts match --categories {args.categories!r}")
    return Plan(
        modes,
        _float_list(pick("temperatures"), "--temperatures"),
        _int_list(str(concurrency or preset["concurrency"]), "--concurrency"),
        draft_lengths,
        prompts,
        max_new,
        max(1, int(pick("cost_samples"))),
        args.hf_threads or service_threads(args.target_threads),
        args.warm_requests,
    )


def output_paths(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    json_path = Path(args.json) if args.json else Path("bench-results") / "bench.json"
    md = Path(args.markdown) if args.markdown else json_path.with_suffix(".md")
    png = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    return json_path, md, png


def interleave_slices(n_items: int, concurrency: int, requested: int) -> list[range]:
    """Contiguous slices of the prompt set that every mode runs in turn (one slice: the whole set).

    A slice keeps at least `concurrency` prompts, so interleaving never leaves clients idle by design.
    """
    n = max(1, min(requested, n_items // max(1, concurrency)))
    bounds = [round(i * n_items / n) for i in range(n + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]
