"""The cost ratio c, measured in-process: draft time per token / target time per forward."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.sampler import SamplingParams
from specd.tools.bench.stats import percentile


def measure_forward_ms(
    model: Any, prompt_ids: list[int], *, threads: int, samples: int, block: int = 1, warmup: int = 3
) -> float:
    """Median ms of one forward over `block` new tokens with a warm KV cache (CausalLMRunner, as the services)."""
    runner = CausalLMRunner(model)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        s = runner.new_session(prompt_ids)
        runner.logits(s)  # prefill
        times: list[float] = []
        token = prompt_ids[-1]
        for i in range(samples + warmup):
            runner.append(s, [token] * block)
            t0 = time.perf_counter()
            runner.logits(s, block)
            dt = (time.perf_counter() - t0) * 1e3
            if block > 1:
                runner.truncate(s, len(s) - block + 1)  # a round keeps accepted + 1 tokens; keep 1
            if i >= warmup:
                times.append(dt)
        return percentile(times, 50)
    finally:
        torch.set_num_threads(previous)


def measure_ngram_ms(
    prompt_ids: list[int], *, samples: int, num_tokens: int = 4, warmup: int = 3, kind: str = "ngram"
) -> float:
    """Median ms per proposed token of a model-free drafter (n-gram or suffix) over the prompt, as the draft
    service runs it (the suffix drafter's learned index empty: its own index is what a first request reads)."""
    vocab = max(prompt_ids) + 1
    drafter = SuffixDrafter(vocab) if kind == "suffix" else NgramDrafter(vocab)
    times: list[float] = []
    for i in range(samples + warmup):
        drafter.open("probe", prompt_ids, SamplingParams(temperature=0.0))
        t0 = time.perf_counter()
        found = drafter.propose(ProposeRequest("probe", len(prompt_ids), len(prompt_ids), [], num_tokens))
        dt = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(dt / max(1, len(found.token_ids)))
    return percentile(times, 50)


def measure_cost(
    target_model: Any,
    draft_model: Any | None,
    prompt_ids: list[int],
    *,
    target_threads: int,
    draft_threads: int,
    samples: int,
    draft_lengths: Iterable[int],
    model_free: str = "ngram",
) -> dict[str, Any]:
    """c = draft ms per token / target ms per 1-token forward, plus the target's K+1-token verify time.

    draft_model None: the model-free drafter `model_free` (ngram, suffix), timed per proposed token.
    """
    target_ms = measure_forward_ms(target_model, prompt_ids, threads=target_threads, samples=samples)
    draft_ms = (
        measure_ngram_ms(prompt_ids, samples=samples, kind=model_free)
        if draft_model is None
        else measure_forward_ms(draft_model, prompt_ids, threads=draft_threads, samples=samples)
    )
    verify = {
        str(k): measure_forward_ms(
            target_model, prompt_ids, threads=target_threads, samples=max(3, samples // 3), block=k + 1
        )
        for k in sorted(set(draft_lengths))
    }
    return {
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "c": draft_ms / target_ms if target_ms > 0 else None,
        "target_verify_ms": verify,  # K -> ms of one forward over K + 1 tokens
        "target_threads": target_threads,
        "draft_threads": draft_threads,
        "samples": samples,
    }
