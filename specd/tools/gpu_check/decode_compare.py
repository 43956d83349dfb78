"""One decode step of specd's runner against one step of a plain transformers `generate`.

Same model, one sequence, `context` tokens of prompt. specd: append one token to a prefilled
session and run `logits(s, 1)`, per step. transformers: ``generate`` with greedy decoding and
its own DynamicCache; a step is (T(1 + steps new tokens) - T(1 new token)) / steps, which
takes the prefill and generate's set-up out. specd has no static-cache / torch.compile
decode path, so there is no third column to measure (the summary says so).
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel

from specd.core.model.runner import CausalLMRunner
from specd.tools.gpu_check.timing import median_ms, timed_ms

__all__ = ["NO_COMPILED_PATH", "generate_step_ms", "runner_step_ms"]

NO_COMPILED_PATH = "specd has no static-cache torch.compile decode path: nothing to compare against"


def runner_step_ms(runner: CausalLMRunner, context: int, steps: int, warmup: int = 3) -> float:
    """Median ms of one cached decode step (append 1 token, logits of it) after `context` tokens."""
    rng = random.Random(1)
    s = runner.new_session([rng.randrange(runner.vocab_size) for _ in range(context)])
    runner.logits(s, 1)  # prefill, untimed
    device = runner.model.device
    times: list[float] = []
    for i in range(warmup + steps):
        runner.append(s, [rng.randrange(runner.vocab_size)])
        ms = timed_ms(lambda: runner.logits(s, 1), device)
        if i >= warmup:
            times.append(ms)
    return median_ms(times)


def _generate_ms(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int) -> float:
    @torch.inference_mode()
    def run() -> None:
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    return timed_ms(run, prompt.device)


def generate_step_ms(model: PreTrainedModel, context: int, steps: int, repeats: int = 3) -> float:
    """Median over `repeats` of (T(generate 1 + steps tokens) - T(generate 1 token)) / steps."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, int(model.config.vocab_size), (1, context), generator=g).to(model.device)
    _generate_ms(model, prompt, 2)  # warm-up: kernels, allocator
    per_step = []
    for _ in range(repeats):
        one = _generate_ms(model, prompt, 1)
        many = _generate_ms(model, prompt, 1 + steps)
        per_step.append(max(0.0, many - one) / steps)
    return median_ms(per_step)
