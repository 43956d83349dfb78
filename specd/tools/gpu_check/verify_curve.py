"""The verify-cost curve of specd's runner: T(n) for n new tokens per session, at batch B.

What the design rests on: verifying K draft tokens (n = K + 1 rows) costs about one decode
step (n = 1) while the GPU is memory-bound. Each sample appends n random tokens to every
session of the batch, times the runner's forward over them (`logits` for one session,
`logits_batch` for many: exactly what the target service runs), and rolls back, as a round
that rejects them would. The n values are interleaved sample by sample so that drift
(clocks, other load) slows them all alike.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from specd.core.model.runner import CausalLMRunner, KVSession
from specd.tools.gpu_check.timing import median_ms, timed_ms

__all__ = ["CurvePoint", "curve_ratios", "measure_curve"]


@dataclass(frozen=True)
class CurvePoint:
    batch: int  # sessions in the forward
    new: int  # new positions per session (n = K + 1 for a verify of K drafts)
    context: int  # cached positions per session before the forward
    median_ms: float
    samples: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _sessions(runner: CausalLMRunner, rng: random.Random, batch: int, context: int) -> list[KVSession]:
    """`batch` sessions of `context` random tokens, prefilled (untimed), one forward per 8 sessions."""
    sessions = [runner.new_session([rng.randrange(runner.vocab_size) for _ in range(context)]) for _ in range(batch)]
    for i in range(0, batch, 8):
        group = sessions[i : i + 8]
        runner.logits_batch(group, [1] * len(group))
    return sessions


def _verify_ms(runner: CausalLMRunner, sessions: list[KVSession], new: int, rng: random.Random) -> float:
    """ms of one forward over `new` fresh tokens per session; the sessions are rolled back after."""
    lengths = [len(s) for s in sessions]
    for s in sessions:
        runner.append(s, [rng.randrange(runner.vocab_size) for _ in range(new)])
    device = runner.model.device
    ms = timed_ms(lambda: runner.logits_batch(sessions, [new] * len(sessions)), device)
    for s, n in zip(sessions, lengths):
        runner.truncate(s, n)
    return ms


def measure_curve(
    runner: CausalLMRunner, news: list[int], batches: list[int], context: int, samples: int, warmup: int = 2
) -> list[CurvePoint]:
    """Median ms per (batch, n) at `context` cached tokens per session."""
    rng = random.Random(0)
    points: list[CurvePoint] = []
    for batch in batches:
        sessions = _sessions(runner, rng, batch, context)
        times: dict[int, list[float]] = {n: [] for n in news}
        for i in range(warmup + samples):
            for n in rng.sample(news, len(news)):
                ms = _verify_ms(runner, sessions, n, rng)
                if i >= warmup:
                    times[n].append(ms)
        points += [CurvePoint(batch, n, context, median_ms(times[n]), samples) for n in news]
        del sessions
        if runner.model.device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def curve_ratios(points: list[CurvePoint]) -> dict[str, dict[str, float]]:
    """{batch: {n: T(n) / T(1)}} for the points at the smallest context measured."""
    context = min(p.context for p in points)
    base = {p.batch: p.median_ms for p in points if p.new == 1 and p.context == context}
    out: dict[str, dict[str, float]] = {}
    for p in points:
        if p.context == context and p.batch in base:
            out.setdefault(str(p.batch), {})[str(p.new)] = round(p.median_ms / base[p.batch], 4)
    return out
