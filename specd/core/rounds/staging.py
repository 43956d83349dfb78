"""Staged verifies for a TargetPort that verifies in this process (specd.core.inprocess, test fakes).

The target service decides a stage on its model thread (target_service/staging.py);
this is the same rule for a port that verifies with direct calls: a stage for the
round after committed_length tokens waits for that round's verdict, then verifies
the candidate whose (accepted, token_id) the verdict is (or, for a deferred
verdict, the candidate that assumed the deferral), or none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from specd.core.rounds.steps import StagedOutcome, StageRequest, VerifyOutcome, VerifyRequest


class StagedVerdicts:
    """Each session's last verify (its committed length, and its outcome once known), for stages to wait on."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, asyncio.Future[VerifyOutcome | None]]] = {}

    async def verified(self, request: VerifyRequest, verify: Awaitable[VerifyOutcome]) -> VerifyOutcome:
        """verify's outcome, noted as the session's last verdict (None for a stage if it failed)."""
        done: asyncio.Future[VerifyOutcome | None] = asyncio.get_running_loop().create_future()
        self._last[request.session_id] = (request.committed_length, done)
        try:
            outcome = await verify
        except BaseException:
            done.set_result(None)
            raise
        done.set_result(outcome)
        return outcome

    async def stage(
        self, request: StageRequest, verify: Callable[[VerifyRequest], Awaitable[VerifyOutcome]]
    ) -> StagedOutcome:
        """Once the round's verdict is known: verify the candidate it names (with `verify`), or none."""
        last = self._last.get(request.session_id)
        if last is None or last[0] != request.committed_length:
            return StagedOutcome.NONE  # not the round being verified: the session moved on
        outcome = await asyncio.shield(last[1])
        if outcome is None:
            return StagedOutcome.NONE
        for i, c in enumerate(request.candidates):
            if c.names(outcome):
                length = c.committed_length(request.committed_length)
                run = VerifyRequest(request.session_id, length, c.proposal, start=length, defer_bonus=c.defer_bonus)
                return StagedOutcome(i, await verify(run))
        return StagedOutcome.NONE

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)
