"""The in-process oracle: the round loop over a Drafter and a Verifier in this process.

The same `RoundLoop` the coordinator runs (specd.core.loop), with local
ports (specd.core.local) instead of gRPC ones: pipelining and adaptive K run
here too, and the service tests compare the services against these results.
Synchronous entry points for tests, distill's evaluation and scripts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from specd.core.branching import DEFAULT_BRANCH_BUDGET
from specd.core.drafting import Drafter
from specd.core.errors import InvalidArgument
from specd.core.generation import FinishReason
from specd.core.local import LocalDraft, LocalTarget
from specd.core.loop import GenerateSpec, LoopSettings, RequestRun, RoundLoop
from specd.core.record import RoundRecord, RoundStats
from specd.core.sampling import SamplingParams
from specd.core.verification import Verifier

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
) -> GenerationResult:
    """Run one request's rounds in-process; drafter None or draft_length 0 = target-only.

    speculation: fixed (K = draft_length) or auto (adaptive K up to draft_length);
    pipeline: off | bonus-match | post-verify | spec-cache (specd.core.pipeline), the
    latter with branch_budget branches per round.
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
            raise InvalidArgument(f"draft length K must be >= 1 when speculating (got {k})")
        specs.append(
            GenerateSpec(
                prompt_ids=[int(t) for t in prompt],
                params=p,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stops,
                speculation=speculation if drafter is not None and k > 0 else "off",
                draft_length=k,
                pipeline=pipeline,
            )
        )

    async def run_all() -> list[GenerationResult]:
        settings = LoopSettings(branch_budget=branch_budget)
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
