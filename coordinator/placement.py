"""Which replica holds each session, and where a new session goes.

Pure bookkeeping (no gRPC): the replica set (coordinator/replicas.py) tells
it which replicas exist, which may take new sessions, and what load each
reports; the ports ask it where to open a session and where one lives.

- A new session goes to the least-loaded usable replica. Load is the
  sessions a replica holds plus the steps queued on it, then its KV bytes,
  then this coordinator's own sessions there; ties are broken at random so
  that coordinators starting together do not all pick the same replica.
- Between two load reports, this coordinator's own placements and closes
  since the report are added to it, so a burst of new sessions spreads
  instead of piling onto the replica that was idlest a second ago.
- A session stays on its replica (its KV cache lives there) until it is
  re-opened while that replica is unusable (gone, draining, unhealthy):
  then it moves, and the caller rebuilds it there from its committed tokens.
- Paired placements (the draft's and the target's, `pair`): the replicas of
  the two roles are paired by their sorted names (one to one when the counts
  match, each of the fewer to several when one count divides the other; no
  pairs otherwise), and a session goes to a replica paired with the one its
  partner session is on, while that replica holds no more than its
  partners' share of sessions. A service batches the steps that are waiting
  when its model thread is free, so a draft replica whose sessions verify on
  one target replica runs them as one cohort, in step with that target's
  batches; mixed, each replica's batches wait on the other replicas' phases
  (emulated h100-tp2-70b at time scale 8, 8 pairs: 0.77 of linear scaling
  mixed, 1.00 paired; docs/results/emulated/scale-out-2026-12-06).
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from specd.core.errors import Unavailable


@dataclass(frozen=True)
class Load:
    """What a replica reports (all coordinators' sessions together)."""

    sessions: int = 0
    kv_bytes: int = 0
    queued_steps: int = 0


@dataclass
class _Slot:
    ours: set[str] = field(default_factory=set)  # this coordinator's sessions on the replica
    reported: Load | None = None
    ours_at_report: int = 0  # len(ours) when `reported` arrived

    def estimate(self) -> tuple[int, int, int]:
        """(sessions + queued steps, KV bytes, our sessions): smaller is less loaded."""
        ours = len(self.ours)
        if self.reported is None:
            return ours, 0, ours
        sessions = max(ours, self.reported.sessions + ours - self.ours_at_report)
        return sessions + self.reported.queued_steps, self.reported.kv_bytes, ours


# A paired replica may hold this many more of our sessions than its partners' share before a new
# session goes to the least-loaded replica instead.
PAIR_SLACK_SESSIONS = 2


class Placement:
    """Session -> replica name, and least-loaded choice among usable replicas."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._slots: dict[str, _Slot] = {}
        self._where: dict[str, str] = {}  # session id -> replica name
        self._rng = rng or random.Random()
        self.partner: Placement | None = None  # the other role's placement (`pair`)

    # ---- replicas ----------------------------------------------------------------

    def add(self, name: str) -> None:
        self._slots.setdefault(name, _Slot())

    def remove(self, name: str) -> set[str]:
        """Forget a replica; returns the sessions that were on it (they move when next opened)."""
        slot = self._slots.pop(name, None)
        if slot is None:
            return set()
        for sid in slot.ours:
            self._where.pop(sid, None)
        return slot.ours

    def report(self, name: str, load: Load) -> None:
        slot = self._slots.get(name)
        if slot is not None:
            slot.reported, slot.ours_at_report = load, len(slot.ours)

    @property
    def replicas(self) -> list[str]:
        return list(self._slots)

    def sessions_on(self, name: str) -> int:
        """This coordinator's sessions on the replica."""
        slot = self._slots.get(name)
        return len(slot.ours) if slot is not None else 0

    def estimate(self, name: str) -> tuple[int, int, int]:
        return self._slots[name].estimate()

    def reported(self, name: str) -> Load | None:
        """The replica's last load report (None before the first)."""
        slot = self._slots.get(name)
        return slot.reported if slot is not None else None

    # ---- sessions -----------------------------------------------------------------

    def where(self, session_id: str) -> str | None:
        return self._where.get(session_id)

    def placed(self) -> list[str]:
        """The sessions placed here now."""
        return list(self._where)

    def place(self, session_id: str, usable: Collection[str], exclude: Collection[str] = ()) -> tuple[str, str | None]:
        """Where to (re)open a session: (replica, the replica it leaves or None).

        It stays where it is if that replica is usable and not excluded;
        otherwise it goes to the least-loaded usable replica not excluded
        (when paired and its partner session is placed, to a replica paired
        with the partner's, within its share). Unavailable if there is none.
        """
        current = self._where.get(session_id)
        if current is not None and current in usable and current not in exclude:
            return current, None
        candidates = [n for n in usable if n in self._slots and n not in exclude]
        if not candidates:
            raise Unavailable("no replica can take a new session (none connected, healthy and serving)")
        scored = [(self._slots[n].estimate(), self._rng.random(), n) for n in candidates]
        group = self.partner.where(session_id) if self.partner is not None else None
        chosen = min(scored)[2] if group is None else self._beside(group, scored)
        self._pin(session_id, chosen)
        return chosen, current

    def _beside(self, group: str, scored: list[tuple[tuple[int, int, int], float, str]]) -> str:
        """The least-loaded candidate paired with the partner replica `group`, while it holds fewer of our
        sessions than its partners' share + PAIR_SLACK_SESSIONS; else the least-loaded candidate."""
        assert self.partner is not None
        least = min(scored)[2]
        mine, theirs = sorted(self._slots), sorted(self.partner.replicas)
        if group not in theirs or max(len(mine), len(theirs)) % min(len(mine), len(theirs)):
            return least  # counts that do not divide would pair unevenly
        # pair k of max(len) pairs: my replica k mod len(mine) with theirs k mod len(theirs); the same
        # sorted names give every coordinator, and both roles, the same pairs
        pairs = [(mine[k % len(mine)], theirs[k % len(theirs)]) for k in range(max(len(mine), len(theirs)))]
        homes = [(est, r, n) for est, r, n in scored if (n, group) in pairs]
        if not homes:
            return least
        home = min(homes)[2]
        share = sum(self.partner.sessions_on(p) / sum(1 for _, q in pairs if q == p) for n, p in pairs if n == home)
        return home if self.sessions_on(home) < share + PAIR_SLACK_SESSIONS else least

    def pair(self, other: Placement) -> None:
        """Place sessions beside their partners in `other` (the other role's placement), and it beside ours."""
        self.partner, other.partner = other, self

    def release(self, session_id: str) -> str | None:
        """The session ended: unpin it; returns the replica it was on."""
        name = self._where.pop(session_id, None)
        if name is not None and name in self._slots:
            self._slots[name].ours.discard(session_id)
        return name

    def _pin(self, session_id: str, name: str) -> None:
        self.release(session_id)
        self._where[session_id] = name
        self._slots[name].ours.add(session_id)
