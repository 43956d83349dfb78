"""Once per run, on the first services: the prompts as token IDs, the cost ratio c and the in-process HF baseline."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.client import CoordinatorClient
from specd.core.model.catalog import MODEL_FREE_DRAFTS
from specd.serving.cpu_budget import service_threads
from specd.tools.bench.console import say
from specd.tools.bench.cost import measure_cost
from specd.tools.bench.hf_baseline import HFBaseline, load_inprocess
from specd.tools.bench.plan import BenchError, Plan
from specd.tools.bench.prompts import BenchPrompt, tokenize_prompt


def prepare_run(
    args: argparse.Namespace,
    plan: Plan,
    address: str,
    tokenizer: Any,
    target_dir: Path,
    draft_dir: Path | None,
    cost: dict[str, Any],
    quiet: bool,
    phase: Callable[[str], None],
) -> tuple[list[tuple[BenchPrompt, list[int]]], HFBaseline | None]:
    """Once per run: the prompts as token IDs (fitted to the context), c and the in-process HF baseline."""
    try:
        with CoordinatorClient(address, timeout=min(args.timeout, 30.0)) as client:
            max_context = int(client.model_info().max_context) or 1 << 30
    except Exception as exc:
        raise BenchError(f"cannot reach the coordinator at {address}: {exc}") from exc
    room = max(1, max_context - plan.max_new_tokens)
    items = [(p, tokenize_prompt(tokenizer, p)[-room:]) for p in plan.prompts]
    hf_baseline: HFBaseline | None = None
    if not args.no_inprocess:
        say("loading the models in-process (the HF baseline and the cost ratio c) ...", quiet)
        target_m, draft_m = load_inprocess(target_dir, draft_dir)
        phase("load_inprocess_s")
        probe = items[0][1]
        # every K some mode drafts with (fixed-6 among default lengths 2, 4), for its S(K) at the measured verify
        verify_ks = sorted({m.draft_length for m in plan.modes if m.draft_length} | set(plan.draft_lengths))
        if draft_m is not None or args.draft in MODEL_FREE_DRAFTS:
            cost["service"] = measure_cost(
                target_m.model,
                draft_m.model if draft_m else None,
                probe,
                target_threads=service_threads(args.target_threads),
                draft_threads=service_threads(args.draft_threads),
                samples=plan.cost_samples,
                draft_lengths=verify_ks,
                model_free=args.draft,
            )
            if draft_m is not None and any(m.hf_baseline for m in plan.modes):
                same = plan.hf_threads == service_threads(args.target_threads) == service_threads(args.draft_threads)
                cost["hf"] = (
                    cost["service"]
                    if same
                    else measure_cost(
                        target_m.model,
                        draft_m.model,
                        probe,
                        target_threads=plan.hf_threads,
                        draft_threads=plan.hf_threads,
                        samples=plan.cost_samples,
                        draft_lengths=verify_ks,
                    )
                )
        if any(m.hf_baseline for m in plan.modes):
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
            hf_baseline = HFBaseline(
                target_m.model, draft_m.model if draft_m else None, threads=plan.hf_threads, pad_token_id=pad
            )
    phase("measure_cost_s")
    return items, hf_baseline
