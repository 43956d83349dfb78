"""The round loop's ports: all it needs from a draft, a target and whoever watches the rounds.

Adapters implement these over a transport: gRPC streams in the coordinator
(coordinator/ports.py), direct calls to a Drafter and a Verifier in-process
(specd/core/inprocess.py), scripted fakes in tests (tests/test_loop.py). The
loop never sees a message, a channel or a span.

Sessions: every call names the request's session. A port that does not know
the session raises SessionNotFound (restart, eviction), one whose sequence
disagrees raises SessionOutOfSync; the loop re-opens it from the committed
tokens. Failures are the domain exceptions of specd.core.errors
(Unavailable and DeadlineExceeded for a slow or broken peer).

carrier: opaque string metadata the observer hands out per round (the W3C
trace context in the coordinator); ports forward it with each message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from specd.core.rounds.record import RoundRecord
from specd.core.rounds.steps import Branches, VerifyOutcome
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams

Carrier = Mapping[str, str]


class DraftPort(Protocol):
    """A drafter holding one token sequence per session."""

    async def available(self) -> bool:
        """May rounds draft now? (connected, and its token space matches the target's)."""
        ...

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None:
        """(Re)build the session's sequence as token_ids."""
        ...

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
        """Roll the sequence back to its first `start` tokens, append `tail` (giving committed_length
        tokens), then draft up to num_tokens tokens after it; the drafts join the sequence."""
        ...

    async def propose_branches(
        self,
        session_id: str,
        committed_length: int,
        start: int,
        tail: Sequence[int],
        pending: int,
        num_tokens: int,
        *,
        budget: int,
        acceptance: Sequence[float],
        timeout: float,
        carrier: Carrier,
    ) -> Branches:
        """A speculation cache's branch call, one batched drafting pass for all branches.

        Bring the sequence to its prefix as propose does (committed_length tokens,
        the last `pending` of them the proposal being verified), choose up to
        `budget` verdicts of those pending tokens (specd.core.draft.branching) and draft
        num_tokens tokens after each. The branches are kept until the session's
        next call, which continues the one it extends; every branch shares the
        prefix's first committed_length - pending tokens, so that call's `start`
        must not exceed them."""
        ...

    async def close(self, session_id: str, *, timeout: float, committed: Sequence[int] = (), start: int = 0) -> None:
        """Forget the session. `committed` is its final committed sequence, of which the draft holds
        the first `start`: a drafter that learns across sessions (suffix) indexes the whole answer."""
        ...


class TargetPort(Protocol):
    """A verifier holding the committed sequence of each session; it commits its own verdicts."""

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None: ...

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
        """Verify `proposal` after the session's first committed_length tokens (rolling back any verdict
        the caller never saw) and commit the verdict. defer_bonus: if all are accepted, draw no bonus."""
        ...

    async def close(self, session_id: str, *, timeout: float) -> None: ...


class RoundObserver(Protocol):
    """Watches one request's rounds (tracing, metrics); called by the loop, never raises into it."""

    def round_started(self, index: int, committed_length: int) -> Carrier:
        """A round begins; returns the carrier its messages forward."""
        ...

    def round_event(self, message: str, error: BaseException) -> None:
        """Something the round survived (a draft failure, a target retry)."""
        ...

    def round_ended(self, record: RoundRecord) -> None: ...

    def round_failed(self, error: BaseException) -> None:
        """The round (and so the request) ended with `error`, or was cancelled."""
        ...


class NoObserver:
    """Watches nothing (the in-process loop)."""

    def round_started(self, index: int, committed_length: int) -> Carrier:
        return {}

    def round_event(self, message: str, error: BaseException) -> None:
        pass

    def round_ended(self, record: RoundRecord) -> None:
        pass

    def round_failed(self, error: BaseException) -> None:
        pass
