"""A step's phases: durations on the monotonic clock, epoch times only for the spans."""

from __future__ import annotations

import time

import pytest

from specd.core import phases as ph
from specd.core.phases import PhaseLog


def test_a_wall_clock_step_mid_phase_changes_neither_its_length_nor_the_spans_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = PhaseLog()
    with log.phase(ph.SYNC):
        pass
    # The wall clock is stepped 50 ms ahead mid-step (an NTP step, a VM resumed): the batch window
    # the service measures on the monotonic clock is unaffected, and so must the compute time be.
    stepped = time.time_ns() + 50_000_000
    monkeypatch.setattr(time, "time_ns", lambda: stepped)
    t0 = time.perf_counter_ns()
    with log.phase(ph.FORWARD):
        time.sleep(0.002)
    window_ms = (time.perf_counter_ns() - t0) / 1e6
    assert 2.0 <= log.total_ms(ph.FORWARD) <= window_ms
    compute_ms = (log.phases[-1].end_ns - log.phases[0].start_ns) / 1e6
    assert compute_ms < 50.0
    # Spans: epoch times from one offset taken when the log was made, so they keep their sequence.
    sync, forward = log.merged()
    assert log.epoch_ns(sync.end_ns) <= log.epoch_ns(forward.start_ns) < stepped
    assert abs(log.epoch_ns(forward.end_ns) - (stepped - 50_000_000)) < 1_000_000_000


def test_merged_phases_cover_their_steps_and_total_adds_them() -> None:
    log = PhaseLog()
    log.add(ph.FORWARD, 10, 20)
    log.add(ph.SAMPLING, 20, 25)
    log.add(ph.FORWARD, 25, 40)
    assert [(p.name, p.start_ns, p.end_ns) for p in log.merged()] == [(ph.FORWARD, 10, 40), (ph.SAMPLING, 20, 25)]
    assert log.total_ms(ph.FORWARD) == pytest.approx(25e-6)
