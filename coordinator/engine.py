"""The coordinator's engine: the round loop over the gRPC ports, plus the API edge.

The rounds themselves run in specd.core.rounds.loop (the same loop the in-process
oracle runs). What is the coordinator's own: admission, the detokenizer and
its stop strings, the request's latencies, and turning each round's record
into a round span and metrics (`_RoundWatch`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.peers import compatibility_problem
from coordinator.replica_ports import ReplicatedDraft, ReplicatedTarget
from specd.core.errors import ResourceExhausted
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.loop import GenerateSpec, LoopSettings, RoundLoop
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import RequestStats, RoundRecord
from specd.core.rounds.spec import OPENING_AUTO, opening_for
from specd.serving import trace_names, trace_spans
from specd.serving import tracing as tr
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.v1 import common_pb2

__all__ = ["Chunk", "GenerateSpec", "RequestStats", "RoundEngine"]

T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    """What one round gives the client: new tokens and final text; the last one ends the request."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None


class _RoundWatch:
    """A request's RoundObserver: a span per round (its numbers from the record), metrics, the record log."""

    def __init__(
        self,
        tracing: tr.Tracing,
        parent: tr.Span | None,
        metrics: CoordinatorMetrics | None,
        records: deque[RoundRecord],
        replicas: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self._tracing = tracing
        self._parent = parent
        self._metrics = metrics
        self._records = records
        self._replicas = replicas  # span attribute -> the replica holding the session now
        self._span: tr.Span = tr.INVALID_SPAN

    def round_started(self, index: int, committed_length: int) -> Carrier:
        self._span = self._tracing.start_round(self._parent, index, committed_length)
        return self._tracing.inject(self._span)

    def round_event(self, message: str, error: BaseException) -> None:
        if self._span.is_recording():
            self._span.add_event(message, {trace_names.ATTR_ERROR_TYPE: type(error).__name__})

    def round_ended(self, record: RoundRecord) -> None:
        if self._span.is_recording():
            self._span.set_attributes(trace_spans.round_attributes(record))
            self._span.set_attributes(self._replicas())
        self._span.end()
        self._span = tr.INVALID_SPAN
        self._records.append(record)
        if self._metrics is not None:
            self._metrics.observe_round(record)

    def round_failed(self, error: BaseException) -> None:
        trace_spans.record_error(self._span, error)
        self._span.end()  # a round cut short by an error or cancellation
        self._span = tr.INVALID_SPAN


class RoundEngine:
    def __init__(
        self,
        config: CoordinatorConfig,
        tokenizer: PreTrainedTokenizerBase,
        target: ReplicatedTarget,
        draft: ReplicatedDraft | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.loop = RoundLoop(
            target,
            draft,
            LoopSettings(
                draft_timeout_s=config.draft_timeout_s,
                target_timeout_s=config.target_timeout_s,
                draft_retry_s=config.draft_retry_s,
                branch_budget=config.branch_budget,
                adapt_branch_budget=config.adapt_branch_budget,
                opening="draft-first" if config.opening == OPENING_AUTO else config.opening,
            ),
        )
        self.target_info: common_pb2.ModelInfo | None = None
        self._active = 0
        self.round_records: deque[RoundRecord] = deque(maxlen=100_000)  # the latest rounds, for measurement
        self._active_tokens = 0  # prompt + max_new_tokens of the requests being served (--max-active-tokens)
        # Tokenizing a prompt at the context limit takes ~100 ms (the demo's 8,192 tokens): off the
        # event loop, in a bounded pool, so one caller's prompt never stalls everyone's streams.
        self._prompt_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="specd-tokenize")
        self._preparing = 0  # admitted requests waiting for (or in) the pool
        self.tracing: tr.Tracing = tr.TRACING_OFF  # the service sets these before it serves
        self.metrics: CoordinatorMetrics | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self, timeout_s: float = 60.0) -> None:
        """Find the replicas; a target replica must answer, drafts may come later.

        The first target replica checked sets the model (its ModelInfo) that the other
        target replicas must match and that draft replicas are checked against.
        """
        deadline = time.monotonic() + timeout_s
        targets = self.target.replicas
        await targets.start()
        if not await targets.wait_usable(timeout_s):
            raise targets.no_replica_error()
        await targets.wait_polled(min(10.0, max(0.1, deadline - time.monotonic())))
        self.target_info = next(m.info for m in targets.members.values() if m.usable and m.info is not None)
        if self.draft is not None:
            target_info = self.target_info
            self.draft.replicas.set_check(lambda info: compatibility_problem(target_info, info))
            await self.draft.replicas.start()
            await self.draft.replicas.wait_usable(min(10.0, max(0.1, deadline - time.monotonic())))
            await self.draft.replicas.wait_polled(min(10.0, max(0.1, deadline - time.monotonic())))
            if self.config.opening == OPENING_AUTO:  # decided now: a draft replica that joins later changes nothing
                kinds = {m.info.kind for m in self.draft.replicas.members.values() if m.usable and m.info is not None}
                self.loop.settings = replace(self.loop.settings, opening=opening_for(kinds))

    async def stop(self) -> None:
        self.stop_prompt_pool()
        await self.loop.drain(timeout=2.0)
        await self.target.replicas.close()
        if self.draft is not None:
            await self.draft.replicas.close()

    def stop_prompt_pool(self) -> None:
        """Stop tokenizing: queued prompts are dropped, one being tokenized finishes in its thread."""
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    def replica_attributes(self, session_id: str) -> dict[str, str]:
        """Span attributes naming the replicas that hold the session now."""
        out = {}
        for key, port in ((trace_names.ATTR_TARGET_REPLICA, self.target), (trace_names.ATTR_DRAFT_REPLICA, self.draft)):
            replica = port.replica_of(session_id) if port is not None else None
            if replica is not None:
                out[key] = replica
        return out

    @property
    def active_requests(self) -> int:
        return self._active

    @property
    def max_context(self) -> int:
        assert self.target_info is not None, "engine not started"
        return self.target_info.max_context

    @property
    def vocab_size(self) -> int:
        assert self.target_info is not None, "engine not started"
        return self.target_info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        assert self.target_info is not None, "engine not started"
        return frozenset(self.target_info.eos_token_ids)

    # ---- one request -----------------------------------------------------------

    async def off_loop(self, work: Callable[[], T]) -> T:
        """work() in the prompt pool (tokenizing, templating); the request counts for admission meanwhile."""
        self._preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, work)
        finally:
            self._preparing -= 1

    def admit(self, tokens: int = 0) -> None:
        """Room for one more request of `tokens` (prompt + max_new_tokens), or ResourceExhausted.

        Requests still being tokenized count too, and cancelled or expired ones until their peers
        answered the close: the work a peer may still run for them (one batch at most: a close
        withdraws what is queued) keeps its slot, so a flood of abandoned requests cannot queue
        more than admission allows. A request that finished frees its slot at once (a client's
        next request may follow its answer straight away)."""
        busy = self._active + self._preparing + self.loop.abandoned_closing
        if busy >= self.config.max_concurrent_requests:
            raise ResourceExhausted(
                f"the coordinator is serving its limit of {self.config.max_concurrent_requests} requests; retry later"
            )
        limit = self.config.max_active_tokens
        if limit and self._active_tokens + tokens > limit:
            raise ResourceExhausted(
                f"the coordinator holds {self._active_tokens} of its {limit} tokens of requests in flight and this "
                f"one needs {tokens}; retry later"
            )

    async def generate(
        self, spec: GenerateSpec, *, deadline: float, arrival: float | None = None, span: tr.Span | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Run the request's rounds, yielding a Chunk per round; the last one has finish_reason and stats.

        span: the request's (Generate) span; each round gets a child span.
        """
        tokens = len(spec.prompt_ids) + spec.max_new_tokens
        self.admit(tokens)
        self._active += 1
        self._active_tokens += tokens
        try:
            arrival = time.monotonic() if arrival is None else arrival
            sid = uuid.uuid4().hex
            if span is not None and span.is_recording():
                span.set_attribute(trace_names.ATTR_SESSION_ID, trace_spans.hashed_session_id(sid))
            detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_ids, spec.stop_strings)
            run = self.loop.run(
                spec,
                max_context=self.max_context,
                session_id=sid,
                deadline=deadline,
                stop=detok.push,
                observer=_RoundWatch(
                    self.tracing, span, self.metrics, self.round_records, lambda: self.replica_attributes(sid)
                ),
            )
            first_token_at: float | None = None
            async with aclosing(run.rounds()) as rounds:
                async for record in rounds:
                    first_token_at = first_token_at or time.monotonic()
                    if run.finish_reason is None:
                        yield Chunk(list(record.committed), detok.take())
                        continue
                    elapsed = time.monotonic() - arrival
                    generated = run.generation.generated
                    stats = RequestStats(
                        rounds=run.stats,
                        prompt_tokens=len(spec.prompt_ids),
                        completion_tokens=len(generated),
                        time_to_first_token_ms=(first_token_at - arrival) * 1e3,
                        tokens_per_s=len(generated) / elapsed if elapsed > 0 else 0.0,
                        seed=spec.params.seed,
                    )
                    yield Chunk(list(record.committed), detok.take(final=True), run.finish_reason, stats)
        finally:
            self._active -= 1
            self._active_tokens -= tokens
