"""Scripted ports for the round loop's tests: a greedy target and a draft that is right most of the time.

Both are pure functions of the prefix, so the right output is known (the
target's greedy chain) whatever the loop does, and every proposal the target
receives can be checked against what the draft says for the committed prefix:
a draft made for any other prefix shows up in `FakeTarget.violations`.
Failures, hangs, lost sessions and latencies are scripted per call number
(1-based).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specd.core.drafting import sync_prefix
from specd.core.errors import DeadlineExceeded, SessionNotFound, SessionOutOfSync, SpecdError, Unavailable
from specd.core.phases import PhaseLog
from specd.core.ports import Carrier
from specd.core.proposal import Proposal
from specd.core.record import RoundRecord
from specd.core.sampling import SamplingParams
from specd.core.verification import VerifyOutcome

V = 61  # vocabulary size


def target_next(prefix: Sequence[int]) -> int:
    """The target's greedy token after `prefix`."""
    a, b = prefix[-1], prefix[-2] if len(prefix) > 1 else 0
    return (a * 7 + b * 3 + len(prefix)) % V


def agree_mostly(prefix: Sequence[int]) -> bool:
    return (prefix[-1] + len(prefix)) % 4 != 0  # ~3 in 4


def draft_next(prefix: Sequence[int], agrees: Callable[[Sequence[int]], bool] = agree_mostly) -> int:
    t = target_next(prefix)
    return t if agrees(prefix) else (t + 1) % V


def chain(prefix: Sequence[int], n: int, step: Callable[[Sequence[int]], int]) -> list[int]:
    seq = list(prefix)
    for _ in range(n):
        seq.append(step(seq))
    return seq[len(prefix) :]


@dataclass
class Script:
    """What happens at call n (1-based) of a port."""

    latency_s: float = 0.001
    fail: dict[int, SpecdError] = field(default_factory=dict)  # raise this at call n
    hang: set[int] = field(default_factory=set)  # never answer call n (the transport times out)
    forget: set[int] = field(default_factory=set)  # lose the session just before call n
    slow: dict[int, float] = field(default_factory=dict)  # extra latency at call n

    async def before(self, n: int, timeout: float, sessions: dict[str, list[int]], sid: str) -> None:
        await asyncio.sleep(self.latency_s + self.slow.get(n, 0.0))
        if n in self.hang:
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"no answer within {timeout:.2f} s")
        if n in self.fail:
            raise self.fail[n]
        if n in self.forget:
            sessions.pop(sid, None)


class FakeTarget:
    """A TargetPort with the greedy target_next; checks each proposal against the draft for its prefix."""

    def __init__(self, script: Script | None = None, draft: Callable[[Sequence[int]], int] | None = draft_next) -> None:
        self.script = script or Script()
        self.draft = draft  # what a correct proposal is made of (None: do not check)
        self.sessions: dict[str, list[int]] = {}
        self.calls = 0
        self.opens = 0
        self.closed: list[str] = []
        self.carriers: list[Carrier] = []
        self.violations: list[tuple[list[int], list[int]]] = []  # (committed prefix, proposal) drafted elsewhere

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None:
        self.opens += 1
        self.sessions[session_id] = list(token_ids)

    async def verify(
        self,
        session_id: str,
        committed_length: int,
        proposal: Proposal,
        *,
        defer_bonus: bool,
        timeout: float,
        carrier: Carrier,
    ) -> VerifyOutcome:
        self.calls += 1
        self.carriers.append(carrier)
        await self.script.before(self.calls, timeout, self.sessions, session_id)
        if session_id not in self.sessions:
            raise SessionNotFound(f"no session {session_id}")
        held = self.sessions[session_id]
        if len(held) < committed_length:
            raise SessionOutOfSync("behind")
        prefix = held[:committed_length]  # roll back a verdict the caller did not see
        drafts = list(proposal.token_ids)
        if self.draft is not None and drafts != chain(prefix, len(drafts), self.draft):
            self.violations.append((prefix, drafts))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target_next(prefix + drafts[:accepted]):
            accepted += 1
        committed = prefix + drafts[:accepted]
        deferred = defer_bonus and 0 < len(drafts) == accepted
        token = -1 if deferred else target_next(committed)
        self.sessions[session_id] = committed + ([] if deferred else [token])
        return VerifyOutcome(
            accepted=accepted,
            token_id=token,
            is_bonus=accepted == len(drafts) and not deferred,
            committed_length=len(self.sessions[session_id]),
            compute_ms=self.script.latency_s * 1e3,
            phases=PhaseLog(batch_size=1, batch_tokens=len(drafts) + 1),
            deferred=deferred,
        )

    async def close(self, session_id: str, *, timeout: float) -> None:
        self.closed.append(session_id)
        self.sessions.pop(session_id, None)


class FakeDraft:
    """A DraftPort drafting with `step`; `lie` makes call n send one token more than asked."""

    def __init__(
        self,
        script: Script | None = None,
        step: Callable[[Sequence[int]], int] = draft_next,
        *,
        lie: set[int] | None = None,
        short: set[int] | None = None,
    ) -> None:
        self.script = script or Script()
        self.step = step
        self.lie = lie or set()
        self.short = short or set()  # call n proposes one token fewer than asked
        self.up = True
        self.sessions: dict[str, list[int]] = {}
        self.calls = 0
        self.opens = 0
        self.closed: list[str] = []
        self.final: dict[str, list[int]] = {}  # the committed tokens each close carried
        self.prefixes: list[list[int]] = []  # the prefix of every propose, in order

    async def available(self) -> bool:
        return self.up

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None:
        self.opens += 1
        self.sessions[session_id] = list(token_ids)

    async def propose(
        self,
        session_id: str,
        committed_length: int,
        start: int,
        tail: Sequence[int],
        num_tokens: int,
        *,
        timeout: float,
        carrier: Carrier,
    ) -> Proposal:
        self.calls += 1
        n = self.calls
        await self.script.before(n, timeout, self.sessions, session_id)
        if session_id not in self.sessions:
            raise SessionNotFound(f"no session {session_id}")
        prefix = sync_prefix(self.sessions[session_id], committed_length, start, tail)
        self.prefixes.append(prefix)
        k = num_tokens + (1 if n in self.lie else 0) - (1 if n in self.short else 0)
        drafts = chain(prefix, max(0, k), self.step)
        self.sessions[session_id] = prefix + drafts
        return Proposal(drafts, compute_ms=self.script.latency_s * 1e3)

    async def close(self, session_id: str, *, timeout: float, committed: Sequence[int] = (), start: int = 0) -> None:
        self.closed.append(session_id)
        self.final[session_id] = list(committed)
        self.sessions.pop(session_id, None)


class Watch:
    """A RoundObserver that keeps everything it is told."""

    def __init__(self) -> None:
        self.started: list[tuple[int, int]] = []
        self.events: list[tuple[str, str]] = []
        self.records: list[RoundRecord] = []
        self.failed: list[BaseException] = []

    def round_started(self, index: int, committed_length: int) -> Carrier:
        self.started.append((index, committed_length))
        return {"round": str(index)}

    def round_event(self, message: str, error: BaseException) -> None:
        self.events.append((message, type(error).__name__))

    def round_ended(self, record: RoundRecord) -> None:
        self.records.append(record)

    def round_failed(self, error: BaseException) -> None:
        self.failed.append(error)


def fail(n: int, error: SpecdError | None = None) -> dict[int, SpecdError]:
    return {n: error or Unavailable(f"scripted failure at call {n}")}
