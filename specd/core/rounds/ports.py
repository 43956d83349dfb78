"""The round loop's ports: all it needs from a draft, a target and whoever watches the rounds.

Adapters implement these over a transport: gRPC streams in the coordinator
(coordinator/replica_ports.py over coordinator/peers.py), direct calls to a
Drafter and a Verifier in-process (specd/core/inprocess.py), scripted fakes
in tests (tests/loop_fakes.py). Every call takes one step message
(specd.core.rounds.steps); the loop never sees a wire message, a channel or
a span.

Sessions: every call names the request's session. A port that does not know
the session raises SessionNotFound (restart, eviction), one whose sequence
disagrees raises SessionOutOfSync; the loop re-opens it from the committed
tokens. Failures are the domain exceptions of specd.core.errors
(Unavailable and DeadlineExceeded for a slow or broken peer).

carrier: opaque string metadata the observer hands out per round (the W3C
trace context in the coordinator); ports forward it with each message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from specd.core.rounds import steps
from specd.core.rounds.record import RoundRecord
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.tree import DraftTree

Carrier = Mapping[str, str]


class DraftPort(Protocol):
    """A drafter holding one token sequence per session; each call takes its step message
    (specd.core.rounds.steps), which says what the call does."""

    async def available(self) -> bool:
        """May rounds draft now? (connected, and its token space matches the target's)."""
        ...

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None: ...

    async def propose(self, request: steps.ProposeRequest, *, timeout: float, carrier: Carrier) -> Proposal: ...

    async def propose_branches(
        self, request: steps.BranchRequest, *, timeout: float, carrier: Carrier
    ) -> steps.Branches: ...

    async def propose_tree(
        self, request: steps.TreeProposeRequest, *, timeout: float, carrier: Carrier
    ) -> DraftTree: ...

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None: ...


class TargetPort(Protocol):
    """A verifier holding the committed sequence of each session; it commits its own verdicts."""

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None: ...

    async def verify(
        self, request: steps.VerifyRequest, *, timeout: float, carrier: Carrier
    ) -> steps.VerifyOutcome: ...

    async def verify_tree(
        self, request: steps.TreeVerifyRequest, *, timeout: float, carrier: Carrier
    ) -> steps.TreeVerifyOutcome: ...

    async def stage(self, request: steps.StageRequest, *, timeout: float, carrier: Carrier) -> steps.StagedOutcome:
        """Stage the next round's verify (steps.StageRequest); returns once the target decided."""
        ...

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None: ...


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
