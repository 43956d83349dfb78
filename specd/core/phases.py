"""Named, timed phases of one model step (sync, forward, sampling, rollback).

The draft and target cores record where a step's time went; the servicers
turn the record into child spans of the message's span (with the recorded
start and end times, so the spans show the real sequence) without the core
knowing about tracing. In a batched step the forward and sampling phases
are shared by every session of the batch: each session's record holds the
same interval, and `batch_size` says how many shared it.

Phase times are on the monotonic clock (perf_counter_ns): a step's compute
time is compared with the service's batch window on that clock (the hops of
specd.core.transit), and a wall clock stepped mid-step made one longer than
the other. A log converts its times to epoch times for the spans (epoch_ns).
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
    start_ns: int  # time.perf_counter_ns() (monotonic; PhaseLog.epoch_ns gives the span time)
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _epoch_offset_ns() -> int:
    """Wall clock minus the monotonic clock, now: adds to a perf_counter_ns() time to give epoch ns."""
    return time.time_ns() - time.perf_counter_ns()


@dataclass
class PhaseLog:
    """Phases in the order they ran; a phase that runs again (a draft's K steps) adds its time."""

    phases: list[Phase] = field(default_factory=list)
    batch_size: int = 1  # sessions that shared the forward pass(es)
    batch_tokens: int = 0  # token positions the shared forward pass ran (all sessions; target only)
    epoch_offset_ns: int = field(default_factory=_epoch_offset_ns)  # taken once per log: its spans keep their order

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter_ns())

    def add(self, name: str, start_ns: int, end_ns: int) -> None:
        self.phases.append(Phase(name, start_ns, end_ns))

    def epoch_ns(self, perf_ns: int) -> int:
        """A phase time as epoch nanoseconds (the spans' clock)."""
        return perf_ns + self.epoch_offset_ns

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
