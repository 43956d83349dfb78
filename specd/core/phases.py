"""Named, timed phases of one model step (sync, forward, sampling, rollback).

The draft and target cores record where a step's time went; the servicers
turn the record into child spans of the message's span (with the recorded
start and end times, so the spans show the real sequence) without the core
knowing about tracing. In a batched step the forward and sampling phases
are shared by every session of the batch: each session's record holds the
same interval, and `batch_size` says how many shared it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Phase names (also the suffix of the span names, see specd.serving.trace_names).
SYNC = "sync"  # bring the session to the committed prefix (may crop the KV cache)
FORWARD = "forward"  # model forward pass(es)
SAMPLING = "sampling"  # processed probabilities, draft sampling or the rejection sampler
ROLLBACK = "rollback"  # cut rejected drafts from the session, commit the verdict


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int  # time.time_ns() (wall clock: spans need epoch times)
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class PhaseLog:
    """Phases in the order they ran; a phase that runs again (a draft's K steps) adds its time."""

    phases: list[Phase] = field(default_factory=list)
    batch_size: int = 1  # sessions that shared the forward pass(es)
    batch_tokens: int = 0  # token positions the shared forward pass ran (all sessions; target only)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.add(name, start, time.time_ns())

    def add(self, name: str, start_ns: int, end_ns: int) -> None:
        self.phases.append(Phase(name, start_ns, end_ns))

    def total_ms(self, name: str) -> float:
        return sum(p.ms for p in self.phases if p.name == name)

    def merged(self) -> list[Phase]:
        """One interval per name (first start to last end), in order of first appearance.

        A K-token draft alternates forward and sampling K times; a span per
        step would be noise, so each name becomes one span covering its steps.
        """
        spans: dict[str, Phase] = {}
        for p in self.phases:
            first = spans.get(p.name)
            spans[p.name] = p if first is None else Phase(p.name, first.start_ns, p.end_ns)
        return list(spans.values())
