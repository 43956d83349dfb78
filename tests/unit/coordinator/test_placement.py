"""Placement: least-loaded choice, pinning, draining, moves (pure bookkeeping, no services)."""

from __future__ import annotations

import random

import pytest

from coordinator.placement import PAIR_SLACK_SESSIONS, Load, Placement
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


def _paired(drafts: int, targets: int) -> tuple[Placement, Placement, list[str], list[str]]:
    d, t = Placement(random.Random(1)), Placement(random.Random(2))
    dn, tn = [f"d{i}" for i in range(drafts)], [f"t{i}" for i in range(targets)]
    for n in dn:
        d.add(n)
    for n in tn:
        t.add(n)
    t.pair(d)
    return d, t, dn, tn


def test_paired_sessions_verify_on_the_target_paired_with_their_draft() -> None:
    d, t, dn, tn = _paired(4, 4)
    sessions = [f"s{i}" for i in range(64)]
    for s in sessions:
        d.place(s, dn)
    # the targets hear of them cohort by cohort, as a draft's batch answers: each cohort stays together
    for s in sorted(sessions, key=lambda s: str(d.where(s))):
        t.place(s, tn)
    pairs = {(d.where(s), t.where(s)) for s in sessions}
    assert len(pairs) == 4 and len({dr for dr, _ in pairs}) == len({tr for _, tr in pairs}) == 4
    assert [t.sessions_on(n) for n in tn] == [16] * 4
    # requests come and go (the draft placed first or the target first): the pairs hold
    rng = random.Random(3)
    for i in range(300):
        gone = sessions.pop(rng.randrange(len(sessions)))
        d.release(gone)
        t.release(gone)
        new = f"n{i}"
        first, second = ((d, dn), (t, tn)) if i % 2 else ((t, tn), (d, dn))
        first[0].place(new, first[1])
        second[0].place(new, second[1])
        sessions.append(new)
    assert {(d.where(s), t.where(s)) for s in sessions} == pairs
    assert [t.sessions_on(n) for n in tn] == [16] * 4


def test_a_draft_paired_with_two_targets_splits_its_sessions_between_them() -> None:
    d, t, dn, tn = _paired(2, 4)
    for i in range(32):
        d.place(f"s{i}", dn)
    for i in sorted(range(32), key=lambda i: str(d.where(f"s{i}"))):
        t.place(f"s{i}", tn)
    targets_of = {dr: {t.where(f"s{i}") for i in range(32) if d.where(f"s{i}") == dr} for dr in dn}
    assert all(len(v) == 2 for v in targets_of.values()) and not set.intersection(*targets_of.values())
    assert [t.sessions_on(n) for n in tn] == [8] * 4


def test_a_paired_replica_past_its_share_sends_new_sessions_to_the_least_loaded() -> None:
    d, t, _, tn = _paired(2, 2)
    for i in range(10):
        assert d.place(f"s{i}", ["d0"])[0] == "d0"  # d1 unusable for a while: d0 holds them all
    chosen = {t.place(f"s{i}", tn)[0] for i in range(10)}
    assert len(chosen) == 1  # d0's paired target takes all 10: its share is d0's sessions
    home = chosen.pop()
    for i in range(5):  # their drafts end (the targets' sessions stay): d0's share drops to 5
        d.release(f"s{i}")
    d.place("new", ["d0"])
    assert t.place("new", tn)[0] != home  # home holds 10 >= 6 + PAIR_SLACK_SESSIONS
    assert PAIR_SLACK_SESSIONS < 10 - 6


def test_counts_that_do_not_divide_place_by_load_alone() -> None:
    d, t, _, tn = _paired(3, 4)
    for i in range(12):
        d.place(f"s{i}", ["d0"])
    for i in range(12):
        t.place(f"s{i}", tn)
    assert [t.sessions_on(n) for n in tn] == [3] * 4
