"""The KV-cache budget a model service runs with when none is set: on CUDA, from the memory left after loading.

vLLM sizes its cache from `gpu_memory_utilization` of the GPU's memory; here
the budget is a fraction of the memory *free after the model loaded*
(`torch.cuda.mem_get_info`, so other processes' use counts), less what one
forward's activations need, halved because a batched step may briefly hold
twice the budget (the sessions' caches plus one pass's padded copy, which
KVBudget.forward_groups keeps within the budget). On CPU the default stays
0 (no limit): host memory is shared with the page cache and other
processes, and the pod's limit is what bounds it, so the Helm chart derives
--max-kv-bytes from that limit instead (docs/deploy.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.core.model.runner import CausalLMRunner

log = logging.getLogger(__name__)

GiB = 2**30
# Logits rows are float32 three times over at the peak of a step: the head's output, its float32
# copy, and the sampler's processed probabilities.
_LOGIT_COPIES = 3


def kv_budget_from_free_memory(free_bytes: int, fraction: float, reserve_bytes: int) -> int:
    """KV-cache bytes for a device with `free_bytes` free once the model is loaded.

    fraction: the share of the free memory this service may use (0 < f <= 1);
    reserve_bytes: what a forward needs beside the cache (activations, logits).
    The rest is halved: a batched step holds the sessions' caches plus one
    pass's padded copy of them, each at most the budget. FailedPrecondition
    when nothing is left (a budget of 0 would mean no limit at all).
    """
    if not 0.0 < fraction <= 1.0:
        raise InvalidArgument(f"--kv-memory-fraction must be in (0, 1] (got {fraction})")
    if free_bytes < 0 or reserve_bytes < 0:
        raise InvalidArgument(f"free and reserved bytes must be >= 0 (got {free_bytes}, {reserve_bytes})")
    usable = int(free_bytes * fraction) - reserve_bytes
    if usable < 2:
        raise FailedPrecondition(
            f"no memory left for a KV cache: {free_bytes / GiB:.2f} GiB are free after loading the model, "
            f"{fraction} of it is {free_bytes * fraction / GiB:.2f} GiB, and a forward needs "
            f"{reserve_bytes / GiB:.2f} GiB for activations; free device memory, raise --kv-memory-fraction, "
            "or set --max-kv-bytes"
        )
    return usable // 2


def activation_bytes(
    *, tokens: int, hidden: int, intermediate: int, logit_rows: int, vocab: int, element_size: int
) -> int:
    """Peak memory of one forward beside the KV cache: a decoder layer's live tensors over `tokens`
    positions (the residual stream and its norm, attention's input and output: ~4 x hidden; the MLP's
    gate, up and their product: ~3 x intermediate) in the model's dtype, plus `logit_rows` rows of
    float32 logits (_LOGIT_COPIES copies). An estimate; vLLM measures it with a profiling pass."""
    layer = tokens * (4 * hidden + 3 * intermediate) * element_size
    logits = logit_rows * vocab * 4 * _LOGIT_COPIES
    return layer + logits


def runner_activation_bytes(runner: CausalLMRunner, logit_rows: int) -> int:
    """activation_bytes for the runner's model and its longest pass: one prompt of max_context tokens
    (a prefill runs whole); batches beyond that which run out of memory are split (KVSessionPool)."""
    config = runner.model.config.get_text_config(decoder=True)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    intermediate = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
    return activation_bytes(
        tokens=runner.max_context,
        hidden=hidden,
        intermediate=intermediate,
        logit_rows=logit_rows,
        vocab=runner.vocab_size,
        element_size=runner.model.dtype.itemsize,
    )


def default_kv_budget(
    runner: CausalLMRunner,
    max_kv_bytes: int,
    fraction: float,
    *,
    logit_rows: int,
    mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
) -> int:
    """The KV budget a service runs with, logged: --max-kv-bytes when set; on CUDA when it is 0,
    kv_budget_from_free_memory over the memory free now (call it right after loading the model);
    elsewhere 0, no limit. logit_rows: the most rows one step samples (max_batch x (K + 1));
    mem_get_info: (free, total) bytes of a device (default torch.cuda.mem_get_info)."""
    device = runner.device
    if max_kv_bytes:
        log.info("KV budget: %d bytes (%.2f GiB, --max-kv-bytes) on %s", max_kv_bytes, max_kv_bytes / GiB, device)
        return max_kv_bytes
    if device.type != "cuda":
        log.info("KV budget: none on %s (--max-kv-bytes 0: sessions are bounded by --max-sessions only)", device)
        return 0
    torch.cuda.empty_cache()  # blocks the loader freed count as free
    free, _total = (mem_get_info or torch.cuda.mem_get_info)(device)
    reserve = runner_activation_bytes(runner, logit_rows)
    budget = kv_budget_from_free_memory(free, fraction, reserve)
    log.info(
        "KV budget: %d bytes (%.2f GiB) on %s = (%.2f GiB free after loading x %s - %.2f GiB for activations) / 2 "
        "(--kv-memory-fraction; --max-kv-bytes sets it outright)",
        budget,
        budget / GiB,
        device,
        free / GiB,
        fraction,
        reserve / GiB,
    )
    return budget
