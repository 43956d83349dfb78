"""scripts/round_timeline.py's matching of a speculation cache's cycle events across the processes."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.script_modules import load_script

MS = 1_000_000  # ns


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("round_timeline", monkeypatch)


def cycle(start: int, key: int, prev: int, *, stage_at: int | None, verdict_at: int) -> list[tuple[int, str, int]]:
    """One cycle's events (ms after `start`): round `prev`'s verdict, then the call for round `key`."""
    events = [
        (start, "verdict", prev),
        (start + 1, "call", key),
        (start + 2, "draft_start", key),
        (start + 8, "draft_end", key),
        (start + 9, "reply", key),
        (start + verdict_at, "verdict", key),
    ]
    if stage_at is not None:
        events.append((start + stage_at, "stage_read", key))
    return [(t * MS, name, k) for t, name, k in events]


def test_cycles_are_matched_by_round_with_their_segments_and_slack(timeline: ModuleType) -> None:
    events = [
        *cycle(0, 10, 8, stage_at=10, verdict_at=12),  # read 2 ms before the verdict: in time
        *cycle(12, 13, 10, stage_at=13, verdict_at=12),  # read 1 ms after it
        *cycle(24, 16, 13, stage_at=None, verdict_at=8),  # answered after the verdict: no stage sent
        (36 * MS, "call", 19),  # the last call only bounds the one before
    ]
    rows = timeline.cycles(events)
    assert len(rows) == 2  # the first call has no verdict of its own round before it in these events
    late, unsent = rows
    assert late[timeline.STAGED] == 1.0 and late[timeline.SLACK] == pytest.approx(-1.0)
    assert late["draft batch (passes + host work)"] == pytest.approx(6.0)
    assert late["coordinator -> target reads the stage"] == pytest.approx(4.0)
    assert late[timeline.CYCLE] == pytest.approx(12.0)
    assert unsent[timeline.STAGED] == 0.0 and unsent[timeline.SLACK] == pytest.approx(-1.0)
    assert "coordinator -> target reads the stage" not in unsent


def test_a_round_key_that_recurs_in_a_later_request_is_not_matched_across_requests(timeline: ModuleType) -> None:
    first = cycle(0, 10, 8, stage_at=10, verdict_at=12) + cycle(12, 13, 10, stage_at=20, verdict_at=21)
    # The next request starts at the same prompt length: its keys repeat the first request's.
    second = cycle(100, 10, 8, stage_at=110, verdict_at=112)
    rows = timeline.cycles([*first, *second, (130 * MS, "call", 13)])
    assert [r[timeline.CYCLE] for r in rows] == [pytest.approx(21.0)]  # 10 -> 13 only: 13 -> 10 spans requests
