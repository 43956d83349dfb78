"""In-process ports: the round loop over a Drafter and a Verifier, with no transport between.

Calls made in one turn of the event loop run as one batched call
(`propose_batch` / `verify_batch`), which is what the batched services do:
many requests' loops, run concurrently, share the forward passes. The model
work runs inline on the event loop (deterministic; nothing else runs there).
Timeouts do not apply to a call that cannot be interrupted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from specd.core.branching import Branches, BranchRequest
from specd.core.drafting import Drafter, DraftResult, DraftWork, ProposeRequest, draft_work
from specd.core.ports import Carrier
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.core.suffix import LearningDrafter
from specd.core.verification import Verifier, VerifyOutcome, VerifyRequest

Req = TypeVar("Req")
Res = TypeVar("Res")


class TurnBatcher(Generic[Req, Res]):
    """Collects the requests submitted in one event-loop turn and runs them as one batch."""

    def __init__(self, run_batch: Callable[[Sequence[Req]], Sequence[Res | Exception]]) -> None:
        self._run_batch = run_batch
        self._pending: list[tuple[Req, asyncio.Future[Res]]] = []

    async def submit(self, request: Req) -> Res:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._pending.append((request, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # after the tasks already scheduled in this turn have submitted
        return await future

    def _flush(self) -> None:
        batch = [(r, f) for r, f in self._pending if not f.done()]  # a cancelled caller is skipped
        self._pending = []
        if not batch:
            return
        try:
            results: Sequence[Res | Exception] = self._run_batch([r for r, _ in batch])
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every caller gets it
            results = [exc] * len(batch)
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


class LocalDraft:
    """DraftPort over a Drafter in this process."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        # Proposes and branch calls of one turn: one batch, as the draft service runs them.
        self._batch: TurnBatcher[DraftWork, DraftResult] = TurnBatcher(lambda work: draft_work(drafter, work))

    async def available(self) -> bool:
        return True

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None:
        self.drafter.open(session_id, token_ids, params)

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
        result = await self._batch.submit(ProposeRequest(session_id, committed_length, start, list(tail), num_tokens))
        assert isinstance(result, Proposal)
        return result

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
        request = BranchRequest(
            session_id, committed_length, start, list(tail), pending, num_tokens, budget, tuple(acceptance)
        )
        result = await self._batch.submit(request)
        assert isinstance(result, Branches)
        return result

    async def close(self, session_id: str, *, timeout: float, committed: Sequence[int] = (), start: int = 0) -> None:
        if isinstance(self.drafter, LearningDrafter) and committed:  # as the draft service's close
            self.drafter.finish(session_id, len(committed), start, committed[start:])
        self.drafter.close(session_id)


class LocalTarget:
    """TargetPort over a Verifier in this process."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self._batch: TurnBatcher[VerifyRequest, VerifyOutcome] = TurnBatcher(verifier.verify_batch)

    async def open(
        self, session_id: str, token_ids: Sequence[int], params: SamplingParams, *, timeout: float, carrier: Carrier
    ) -> None:
        self.verifier.open(session_id, token_ids, params)

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
        # start = committed_length: roll back a verdict the loop never saw, as the service does.
        request = VerifyRequest(session_id, committed_length, proposal, start=committed_length, defer_bonus=defer_bonus)
        return await self._batch.submit(request)

    async def close(self, session_id: str, *, timeout: float) -> None:
        self.verifier.close(session_id)
