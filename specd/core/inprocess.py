"""The in-process oracle: the round loop over a Drafter and a Verifier in this process, and its ports.

The same `RoundLoop` the coordinator runs (specd.core.rounds.loop), with the
in-process ports `LocalDraft` and `LocalTarget` instead of gRPC ones:
pipelining and adaptive K run here too, and the service tests compare the
services against these results. Synchronous entry points for tests,
distill's evaluation and scripts.

The ports: calls made in one turn of the event loop run as one batched call
(`propose_batch` / `verify_batch`), which is what the batched services do:
many requests' loops, run concurrently, share the forward passes. The model
work runs inline on the event loop (deterministic; nothing else runs there).
Timeouts do not apply to a call that cannot be interrupted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from specd.core.draft.protocol import Drafter, draft_work
from specd.core.draft.suffix import LearningDrafter
from specd.core.draft.trees import propose_trees
from specd.core.errors import InvalidArgument
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.loop import GenerateSpec, LoopSettings, RequestRun, RoundLoop
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import RoundRecord, RoundStats
from specd.core.rounds.spec import OPENING_AUTO, opening_for
from specd.core.rounds.staging import StagedVerdicts
from specd.core.rounds.steps import (
    DEFAULT_BRANCH_BUDGET,
    Branches,
    BranchRequest,
    CloseRequest,
    DraftResult,
    DraftWork,
    OpenRequest,
    ProposeRequest,
    StagedOutcome,
    StageRequest,
    TreeProposeRequest,
    TreeVerifyOutcome,
    TreeVerifyRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree
from specd.core.target.verifier import Verifier

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
        self._trees: TurnBatcher[TreeProposeRequest, DraftTree] = TurnBatcher(lambda rs: propose_trees(drafter, rs))

    async def available(self) -> bool:
        return True

    async def open(self, request: OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        self.drafter.open(
            request.session_id, request.token_ids, request.params, tenant=request.tenant, confidence=request.confidence
        )

    async def propose(self, request: ProposeRequest, *, timeout: float, carrier: Carrier) -> Proposal:
        result = await self._batch.submit(request)
        assert isinstance(result, Proposal)
        return result

    async def propose_branches(self, request: BranchRequest, *, timeout: float, carrier: Carrier) -> Branches:
        result = await self._batch.submit(request)
        assert isinstance(result, Branches)
        return result

    async def propose_tree(self, request: TreeProposeRequest, *, timeout: float, carrier: Carrier) -> DraftTree:
        return await self._trees.submit(request)

    async def close(self, request: CloseRequest, *, timeout: float) -> None:
        committed, start = request.committed, request.start
        if isinstance(self.drafter, LearningDrafter) and committed:  # as the draft service's close
            self.drafter.finish(request.session_id, len(committed), start, committed[start:])
        self.drafter.close(request.session_id)


class LocalTarget:
    """TargetPort over a Verifier in this process."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self._batch: TurnBatcher[VerifyRequest, VerifyOutcome] = TurnBatcher(verifier.verify_batch)
        self._trees: TurnBatcher[TreeVerifyRequest, TreeVerifyOutcome] = TurnBatcher(verifier.verify_tree_batch)
        self._staged = StagedVerdicts()

    async def open(self, request: OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        self._staged.forget(request.session_id)
        self.verifier.open(request.session_id, request.token_ids, request.params)

    async def verify(self, request: VerifyRequest, *, timeout: float, carrier: Carrier) -> VerifyOutcome:
        return await self._staged.verified(request, self._batch.submit(request))

    async def stage(self, request: StageRequest, *, timeout: float, carrier: Carrier) -> StagedOutcome:
        return await self._staged.stage(request, lambda v: self.verify(v, timeout=timeout, carrier=carrier))

    async def verify_tree(self, request: TreeVerifyRequest, *, timeout: float, carrier: Carrier) -> TreeVerifyOutcome:
        return await self._trees.submit(request)

    async def close(self, request: CloseRequest, *, timeout: float) -> None:
        self._staged.forget(request.session_id)
        self.verifier.close(request.session_id)


T = TypeVar("T")


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RoundStats
    seconds: float
    records: tuple[RoundRecord, ...] = ()


def speculative_generate(
    prompt: Sequence[int],
    verifier: Verifier,
    drafter: Drafter | None,
    params: SamplingParams,
    *,
    draft_length: int,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    session_id: str = "local",
    speculation: str = "fixed",
    pipeline: str = "off",
    branch_budget: int = DEFAULT_BRANCH_BUDGET,
    adapt_branch_budget: bool = True,
    tenant: str = "",
    tree_budget: int = 0,
    opening: str = OPENING_AUTO,
) -> GenerationResult:
    """Run one request's rounds in-process; drafter None or draft_length 0 = target-only.

    tree_budget N > 0: tree rounds (docs/trees.md), trees of at most N nodes and draft_length
    levels; fixed speculation, pipeline off.

    speculation: fixed (K = draft_length) or auto (adaptive K up to draft_length);
    pipeline: off | bonus-match | post-verify | spec-cache (specd.core.rounds.pipeline), the
    latter with at most branch_budget branches per round (always that many without
    adapt_branch_budget: specd.core.rounds.branch_budget). tenant: whose learned draft state the
    request may use (specd.core.draft.tenant_index; "": none). opening: the first round's
    (specd.core.rounds.spec.OPENINGS: "beside" prefills the target alone, the draft beside it;
    "auto": as the coordinator's --opening auto, by the drafter's kind, `opening_for`).
    """
    return speculative_generate_batch(
        [prompt],
        verifier,
        drafter,
        [params],
        draft_lengths=[draft_length],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        session_ids=[session_id],
        speculation=speculation,
        pipeline=pipeline,
        branch_budget=branch_budget,
        adapt_branch_budget=adapt_branch_budget,
        tenant=tenant,
        tree_budget=tree_budget,
        opening=opening,
    )[0]


def speculative_generate_batch(
    prompts: Sequence[Sequence[int]],
    verifier: Verifier,
    drafter: Drafter | None,
    params: Sequence[SamplingParams],
    *,
    draft_lengths: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    session_ids: Sequence[str] | None = None,
    speculation: str = "fixed",
    pipeline: str = "off",
    branch_budget: int = DEFAULT_BRANCH_BUDGET,
    adapt_branch_budget: bool = True,
    tenant: str = "",
    tree_budget: int = 0,
    opening: str = OPENING_AUTO,
) -> list[GenerationResult]:
    """Many requests at once, each its own loop; their drafts and verifies batch per event-loop turn.

    What the batched services do, in-process: each result equals
    `speculative_generate` of the same request alone (same tokens greedy and
    seeded). draft_lengths: K per request (0 = target-only for that request).
    Any request's error is raised.
    """
    if not len(prompts) == len(params) == len(draft_lengths):
        raise InvalidArgument("prompts, params and draft_lengths need one entry per request")
    ids = list(session_ids) if session_ids is not None else [f"batch-{i}" for i in range(len(prompts))]
    stops = frozenset(int(t) for t in stop_token_ids)
    specs = []
    for prompt, p, k in zip(prompts, params, draft_lengths):
        p.validate()
        if drafter is not None and k < 1:
            what = "a tree's depth (draft length)" if tree_budget else "draft length K"
            raise InvalidArgument(f"{what} must be >= 1 when speculating (got {k})")
        specs.append(
            GenerateSpec(
                prompt_ids=[int(t) for t in prompt],
                params=p,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stops,
                speculation=speculation if drafter is not None and k > 0 else "off",
                draft_length=k,
                pipeline=pipeline,
                tenant=tenant,
                tree_budget=tree_budget,
            )
        )

    async def run_all() -> list[GenerationResult]:
        if opening == OPENING_AUTO:
            opening_now = opening_for({drafter.kind} if drafter is not None else set())
        else:
            opening_now = opening
        settings = LoopSettings(
            branch_budget=branch_budget, adapt_branch_budget=adapt_branch_budget, opening=opening_now
        )
        loop = RoundLoop(LocalTarget(verifier), LocalDraft(drafter) if drafter is not None else None, settings)
        runs = [loop.run(s, max_context=verifier.runner.max_context, session_id=sid) for s, sid in zip(specs, ids)]
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_collect(run)) for run in runs]
        finally:
            await loop.drain()
        seconds = time.perf_counter() - t0
        out = []
        for run, task in zip(runs, tasks):
            assert run.finish_reason is not None
            out.append(GenerationResult(run.generation.generated, run.finish_reason, run.stats, seconds, task.result()))
        return out

    try:
        return run_sync(run_all)
    except BaseExceptionGroup as group:  # a request failed: raise its error, as a direct call would
        raise group.exceptions[0] from None


async def _collect(run: RequestRun) -> tuple[RoundRecord, ...]:
    return tuple([record async for record in run.rounds()])


def run_sync(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code (in a helper thread if a loop already runs here)."""

    async def main() -> T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()
