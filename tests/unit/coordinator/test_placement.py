"""Placement: least-loaded choice, pinning, draining, moves (pure bookkeeping, no services)."""

from __future__ import annotations

import random

import pytest

from coordinator.placement import Load, Placement
from specd.core.errors import Unavailable


def _placement(*names: str) -> Placement:
    p = Placement(random.Random(0))
    for n in names:
        p.add(n)
    return p


def test_new_sessions_spread_evenly_without_reports() -> None:
    p = _placement("a", "b", "c")
    for i in range(30):
        p.place(f"s{i}", ["a", "b", "c"])
    assert [p.sessions_on(n) for n in "abc"] == [10, 10, 10]


def test_a_session_stays_on_its_replica_while_usable() -> None:
    p = _placement("a", "b")
    first, left = p.place("s", ["a", "b"])
    assert left is None
    for _ in range(5):
        p.place("other", ["a", "b"])
        p.release("other")
        assert p.place("s", ["a", "b"]) == (first, None)


def test_reported_load_steers_new_sessions_away_from_a_busy_replica() -> None:
    p = _placement("a", "b")
    p.report("a", Load(sessions=10))  # other coordinators' sessions
    p.report("b", Load(sessions=0))
    chosen = [p.place(f"s{i}", ["a", "b"])[0] for i in range(14)]
    # b takes sessions until it holds as many as a (10), then they alternate
    assert chosen[:10] == ["b"] * 10
    assert sorted(chosen[10:]) == ["a", "a", "b", "b"]


def test_queued_steps_count_and_kv_bytes_break_ties() -> None:
    p = _placement("a", "b")
    p.report("a", Load(sessions=2, queued_steps=3))
    p.report("b", Load(sessions=4))
    assert p.place("s1", ["a", "b"])[0] == "b"  # 4 < 2 + 3
    p.release("s1")
    p.report("a", Load(sessions=4, kv_bytes=100))
    p.report("b", Load(sessions=4, kv_bytes=10))
    assert p.place("s2", ["a", "b"])[0] == "b"


def test_own_sessions_since_a_report_count_until_the_next() -> None:
    p = _placement("a", "b")
    p.report("a", Load(sessions=0))
    p.report("b", Load(sessions=3))
    for i in range(3):
        assert p.place(f"s{i}", ["a", "b"])[0] == "a"  # a's estimate grows with each placement
    p.report("a", Load(sessions=3))  # the report now includes them: not counted twice
    p.release("s0")  # a close since the report lowers the estimate at once
    assert p.estimate("a")[0] == 2


def test_unusable_replicas_get_no_new_session_and_a_session_moves_off_one() -> None:
    p = _placement("a", "b")
    assert p.place("s", ["a"]) == ("a", None)
    # a drains (or is down): the session is re-opened on b and leaves a
    assert p.place("s", ["b"]) == ("b", "a")
    assert p.sessions_on("a") == 0 and p.sessions_on("b") == 1
    with pytest.raises(Unavailable):
        p.place("t", [])


def test_exclude_skips_a_replica_that_refused() -> None:
    p = _placement("a", "b")
    assert p.place("s", ["a", "b"], exclude=["a"])[0] == "b"
    assert p.place("s", ["a", "b"], exclude=["b"]) == ("a", "b")


def test_removing_a_replica_unpins_its_sessions() -> None:
    p = _placement("a", "b")
    p.place("s", ["a"])
    assert p.remove("a") == {"s"}
    assert p.where("s") is None
    assert p.place("s", ["b"]) == ("b", None)
