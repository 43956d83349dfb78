"""The coordinator's round engine: runs the rounds of every request over the peers.

Transport-neutral on the public side (core types in, `Chunk`s out); the
peers translate to the internal streams. Exactness does not depend on the
draft: any failure there turns the round into a target-only round.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.peers import DraftPeer, TargetPeer
from specd.core.adaptive import AdaptiveDraftLength, Estimate, LinearCost, ProbeBudget, observe_round
from specd.core.errors import (
    REQUEST_ERRORS,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    SessionNotFound,
    SessionOutOfSync,
    SpecdError,
    Unavailable,
)
from specd.core.proposal import Proposal
from specd.core.rounds import FinishReason, Generation, RoundStats, StopRule
from specd.core.sampling import SamplingParams
from specd.core.verification import VerifyOutcome
from specd.serving import tracing as tr
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

SPECULATION_MODES = ("auto", "fixed", "off")


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request in core terms."""

    prompt_ids: list[int]
    params: SamplingParams  # seed always set
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    speculation: str = "auto"  # one of SPECULATION_MODES
    draft_length: int = 4  # fixed K, or the largest K automatic mode may pick
    pipeline: str = "off"  # draft round r+1 while round r is verified: off | bonus-match | post-verify


@dataclass
class RequestStats:
    rounds: RoundStats
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    tokens_per_s: float
    seed: int
    draft_ms: float
    verify_ms: float
    overhead_ms: float


@dataclass(frozen=True)
class Chunk:
    """What one round gives the client: new tokens and final text; the last one ends the request."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None


@dataclass
class _PeerSession:
    opened: bool = False
    known: int = 0  # leading committed tokens the peer's sequence agrees with
    refused: bool = False  # the draft refused or failed this request alone: target-only rounds for it


@dataclass
class RoundTiming:
    wall_ms: float
    draft_ms: float
    verify_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.wall_ms - self.draft_ms - self.verify_ms


@dataclass
class _DraftHealth:
    down_until: float = 0.0
    checked_generation: int = -1
    compatible: bool = False
    problem: str = "not checked yet"


def compatibility_problem(target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo) -> str | None:
    """Why a draft cannot speculate for this target, or None if it can."""
    if draft.tokenizer_size != target.tokenizer_size:
        return f"tokenizer sizes differ (draft {draft.tokenizer_size}, target {target.tokenizer_size})"
    if draft.vocab_hash != target.vocab_hash:
        return "token-to-ID maps or special tokens differ (vocab_hash mismatch)"
    if draft.vocab_size > target.vocab_size:
        return f"draft vocabulary ({draft.vocab_size}) is larger than the target's ({target.vocab_size})"
    return None


class RoundEngine:
    def __init__(
        self,
        config: CoordinatorConfig,
        tokenizer: PreTrainedTokenizerBase,
        target: TargetPeer,
        draft: DraftPeer | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.target = target
        self.draft = draft
        self.target_info: common_pb2.ModelInfo | None = None
        self._draft_health = _DraftHealth()
        self._active = 0
        self._background: set[asyncio.Task[None]] = set()
        self.round_timings: deque[RoundTiming] = deque(maxlen=100_000)
        # Service-wide acceptance and cost estimates, read live by every session's adaptive K.
        # The starting guesses count as two rounds, so one unlucky first round cannot switch a
        # good draft off for everyone.
        self._acceptance_prior = Estimate(0.5, weight=2.0)
        self._cost_prior = Estimate(0.2, weight=2.0)
        self._probes = ProbeBudget()  # sessions that stopped speculating take turns to probe
        # How the target's step time grows with the tokens of its batch, and the batch it sees:
        # together the extra cost of a draft token under batching (adaptive.LinearCost.share).
        self._target_cost = LinearCost()
        self._target_batch = Estimate(1.0)
        self.tracing: tr.Tracing = tr.TRACING_OFF  # the service sets these before it serves
        self.metrics: CoordinatorMetrics | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self, timeout_s: float = 60.0) -> None:
        """Connect to the peers; the target must answer, the draft may come later."""
        deadline = time.monotonic() + timeout_s
        while self.target_info is None:
            try:
                self.target_info = await self.target.model_info(timeout=5.0)
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise Unavailable(f"target did not answer within {timeout_s:.0f} s: {exc}") from exc
                await asyncio.sleep(0.2)
        await self.target.stream.wait_connected(max(0.1, deadline - time.monotonic()))
        if self.draft is not None:
            if await self.draft.stream.wait_connected(min(10.0, max(0.1, deadline - time.monotonic()))):
                await self._check_draft()

    async def stop(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        await self.target.stream.close()
        if self.draft is not None:
            await self.draft.stream.close()

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

    # ---- draft health ------------------------------------------------------

    async def _check_draft(self) -> None:
        """Compare the draft's token space with the target's once per stream generation."""
        assert self.draft is not None and self.target_info is not None
        health = self._draft_health
        health.checked_generation = self.draft.stream.generation
        try:
            info = await self.draft.model_info(timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - the draft is optional
            health.compatible, health.problem = False, f"draft GetModelInfo failed: {exc}"
            health.checked_generation = -1
            return
        problem = compatibility_problem(self.target_info, info)
        health.compatible, health.problem = problem is None, problem or ""
        if problem:
            log.error("not speculating with draft %r: %s; serving target-only", info.name, problem)
        else:
            log.info("draft %r (%s) is compatible with target %r", info.name, info.kind, self.target_info.name)

    async def _draft_usable(self) -> bool:
        if self.draft is None:
            return False
        health = self._draft_health
        if time.monotonic() < health.down_until:
            return False
        if not self.draft.stream.connected:
            self.draft.stream.start()  # reconnects in the background; this round is target-only
            return False
        if health.checked_generation != self.draft.stream.generation:
            await self._check_draft()
        return health.compatible

    def _draft_failed(self, why: str) -> None:
        self._draft_health.down_until = time.monotonic() + self.config.draft_retry_s
        log.warning("draft failed (%s); target-only for %.1f s", why, self.config.draft_retry_s)

    # ---- one request -----------------------------------------------------------

    def admit(self) -> None:
        if self._active >= self.config.max_concurrent_requests:
            raise ResourceExhausted(
                f"the coordinator is serving its limit of {self.config.max_concurrent_requests} requests; retry later"
            )

    async def generate(
        self, spec: GenerateSpec, *, deadline: float, arrival: float | None = None, span: tr.Span | None = None
    ) -> AsyncIterator[Chunk]:
        """Run the request's rounds, yielding a Chunk per round; the last one has finish_reason and stats.

        span: the request's (Generate) span; each round gets a child span.
        """
        self.admit()
        self._active += 1
        arrival = time.monotonic() if arrival is None else arrival
        sid = uuid.uuid4().hex
        gen = Generation(spec.prompt_ids, StopRule(spec.max_new_tokens, self.max_context, spec.stop_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_ids, spec.stop_strings)
        target_s, draft_s = _PeerSession(), _PeerSession(known=len(spec.prompt_ids))
        first_token_at: float | None = None
        totals = RoundTiming(0.0, 0.0, 0.0)
        if span is not None and span.is_recording():
            span.set_attribute(tr.ATTR_SESSION_ID, sid)
        round_span = tr.INVALID_SPAN
        adaptive = self._adaptive(spec) if spec.speculation == "auto" else None
        ahead: asyncio.Future[Proposal] | None = None  # pre-draft of the next round (pipelining)
        ready: Proposal | None = None  # a pre-draft that matched: the next round's draft tokens
        try:
            while not gen.done:
                round_start = time.perf_counter()
                round_span = self.tracing.start_round(span, gen.stats.rounds, gen.committed_length)
                if spec.speculation == "off":
                    wanted = 0
                else:
                    wanted = adaptive.next_k(self.batch_share()) if adaptive else spec.draft_length
                budget = gen.draft_budget(wanted)
                proposal, hit = Proposal([]), ready is not None
                if ready is not None:
                    proposal, ready = ready.window(0, budget), None
                    hit = len(proposal) > 0
                elif budget > 0 and await self._draft_usable():
                    proposal = await self._propose(
                        sid, gen.committed, draft_s, draft_s.known, budget, spec.params, deadline, round_span
                    )
                piped = spec.pipeline != "off" and 0 < len(proposal) == budget
                post_verify = piped and spec.pipeline == "post-verify"
                verify = asyncio.ensure_future(
                    self._verify(
                        sid, gen, target_s, proposal, spec.params, deadline, round_span, defer_bonus=post_verify
                    )
                )
                if piped:
                    # Assume every draft token is accepted and draft the next round now.
                    # bonus-match: K+1 tokens, the first a guess of the target's bonus token;
                    # post-verify: K tokens, the first verified next round at the bonus position.
                    ahead = asyncio.ensure_future(
                        self._propose(
                            sid,
                            gen.committed + proposal.token_ids,
                            draft_s,
                            gen.committed_length + len(proposal),
                            wanted + (0 if post_verify else 1),
                            spec.params,
                            deadline,
                            round_span,
                        )
                    )
                try:
                    outcome = await verify
                finally:
                    verify.cancel()  # no-op once done; stops the round if the request was cancelled
                    pre = await ahead if ahead is not None else None  # the draft is busy with it either way
                    ahead = None
                if len(proposal):
                    draft_s.known = gen.committed_length + outcome.accepted
                if (
                    pre is not None
                    and len(pre) >= 2
                    and outcome.is_bonus
                    and outcome.accepted == len(proposal)
                    and pre.token_ids[0] == outcome.token_id
                ):
                    ready = pre.window(1)  # drafted for exactly the prefix this round commits
                    draft_s.known += 1
                elif outcome.deferred and pre is not None and len(pre) >= 1:
                    ready = pre  # drafted after exactly the K accepted tokens; its first fills the bonus position
                self._learn_target_cost(outcome)
                if adaptive is not None:
                    self._learn(adaptive, proposal, outcome)
                gen.stats.pipeline_hits += int(hit)
                new = gen.commit(
                    proposal.token_ids,
                    outcome.accepted,
                    None if outcome.deferred else outcome.token_id,
                    fallback=budget > 0 and not proposal,
                )
                keep = detok.push(new)
                if keep is not None:
                    gen.finish(FinishReason.STOP_STRING, keep=len(gen.generated) - len(new) + keep)
                    new = new[:keep]
                if first_token_at is None:
                    first_token_at = time.monotonic()
                timing = RoundTiming((time.perf_counter() - round_start) * 1e3, proposal.compute_ms, outcome.compute_ms)
                self.round_timings.append(timing)
                totals.wall_ms += timing.wall_ms
                totals.draft_ms += timing.draft_ms
                totals.verify_ms += timing.verify_ms
                self._observe_round(
                    round_span,
                    gen.stats.rounds - 1,
                    budget,
                    proposal,
                    outcome,
                    len(new),
                    timing,
                    target_only=budget > 0 and not proposal,
                    pipeline_hit=hit,
                )
                round_span = tr.INVALID_SPAN
                if gen.done:
                    break
                yield Chunk(new, detok.take())
            assert gen.finish_reason is not None
            elapsed = time.monotonic() - arrival
            stats = RequestStats(
                rounds=gen.stats,
                prompt_tokens=len(gen.prompt),
                completion_tokens=len(gen.generated),
                time_to_first_token_ms=((first_token_at or time.monotonic()) - arrival) * 1e3,
                tokens_per_s=len(gen.generated) / elapsed if elapsed > 0 else 0.0,
                seed=spec.params.seed,
                draft_ms=totals.draft_ms,
                verify_ms=totals.verify_ms,
                overhead_ms=totals.overhead_ms,
            )
            yield Chunk(new, detok.take(final=True), gen.finish_reason, stats)
        except BaseException as exc:
            tr.record_error(round_span, exc)
            raise
        finally:
            self._active -= 1
            self._close_later(sid, target_s.opened, draft_s.opened)
            round_span.end()  # a round cut short by an error or cancellation

    # ---- rounds ------------------------------------------------------------------

    def _adaptive(self, spec: GenerateSpec) -> AdaptiveDraftLength:
        """A session's K controller: its own evidence, shrunk towards the live service-wide estimates."""
        return AdaptiveDraftLength(
            k_max=spec.draft_length,
            acceptance=Estimate(0.0),  # weight 0: no evidence of its own yet (blend reads the service's)
            cost_ratio=Estimate(0.0),
            service_acceptance=self._acceptance_prior,
            service_cost_ratio=self._cost_prior,
            probes=self._probes,
        )

    def batch_share(self) -> float:
        """sigma: what one more draft token per session costs the batched target, in target-only steps."""
        return self._target_cost.share(self._target_batch.value)

    def _learn_target_cost(self, outcome: VerifyOutcome) -> None:
        if outcome.phases.batch_tokens > 0:
            self._target_cost.observe(outcome.phases.batch_tokens, outcome.compute_ms)
            self._target_batch.update(outcome.phases.batch_size, horizon=64.0)

    def _learn(self, adaptive: AdaptiveDraftLength, proposal: Proposal, outcome: VerifyOutcome) -> None:
        """Feed a round to the session's controller and to the service-wide priors."""
        for acceptance, cost in (
            (adaptive.acceptance, adaptive.cost_ratio),
            (self._acceptance_prior, self._cost_prior),
        ):
            observe_round(acceptance, cost, len(proposal), outcome.accepted, proposal.compute_ms, outcome.compute_ms)

    async def _propose(
        self,
        sid: str,
        committed: list[int],
        ds: _PeerSession,
        start: int,
        k: int,
        params: SamplingParams,
        deadline: float,
        round_span: tr.Span = tr.INVALID_SPAN,
    ) -> Proposal:
        """K draft tokens after `committed` (the draft agrees on its first `start`), or none if the draft fails."""
        assert self.draft is not None
        if ds.refused:
            return Proposal([])
        timeout = min(self.config.draft_timeout_s, max(0.0, deadline - time.monotonic()))
        trace = self.tracing.inject(round_span)
        try:
            for _ in range(2):  # a second try after re-opening a session the draft lost
                try:
                    if not ds.opened:
                        await self.draft.open(sid, committed, params, timeout, trace=trace)
                        ds.opened, ds.known, start = True, len(committed), len(committed)
                    return await self.draft.propose(sid, committed, start, k, self.vocab_size, timeout, trace=trace)
                except (SessionNotFound, SessionOutOfSync):
                    ds.opened = False
            raise Unavailable("draft lost the session twice in a row")
        except REQUEST_ERRORS as exc:  # this request's own problem: it alone goes target-only, nobody pauses
            ds.refused = True
            log.warning("draft refused session %s (%s: %s); target-only for it", sid, type(exc).__name__, exc)
            if round_span.is_recording():
                round_span.add_event("draft refused the request; target-only", {tr.ATTR_ERROR_TYPE: type(exc).__name__})
            return Proposal([])
        except SpecdError as exc:  # slow, gone or full: speculation pauses, output stays exact
            ds.opened = False
            self._draft_failed(f"{type(exc).__name__}: {exc}")
            if round_span.is_recording():
                round_span.add_event("draft failed; target-only round", {tr.ATTR_ERROR_TYPE: type(exc).__name__})
            return Proposal([])

    async def _verify(
        self,
        sid: str,
        gen: Generation,
        ts: _PeerSession,
        proposal: Proposal,
        params: SamplingParams,
        deadline: float,
        round_span: tr.Span = tr.INVALID_SPAN,
        *,
        defer_bonus: bool = False,
    ) -> VerifyOutcome:
        """The target's verdict; re-opens lost sessions, retries a broken stream within the budget."""
        trace = self.tracing.inject(round_span)
        failing_since: float | None = None
        backoff = 0.05
        while True:
            now = time.monotonic()
            budget_end = (
                deadline if failing_since is None else min(deadline, failing_since + self.config.target_timeout_s)
            )
            if now >= budget_end:
                raise Unavailable(f"the target could not verify before the deadline ({self.target.stream.last_error})")
            timeout = min(budget_end - now, self.config.target_timeout_s)
            try:
                if not ts.opened:
                    await self.target.open(sid, gen.committed, params, timeout, trace=trace)
                    ts.opened = True
                return await self.target.verify(
                    sid, gen.committed_length, proposal, timeout, trace=trace, defer_bonus=defer_bonus
                )
            except (SessionNotFound, SessionOutOfSync):
                ts.opened = False
            except (Unavailable, DeadlineExceeded) as exc:
                ts.opened = False
                failing_since = failing_since or now
                log.warning("target round failed (%s); retrying", exc)
                if round_span.is_recording():
                    round_span.add_event("target failed; retrying", {tr.ATTR_ERROR_TYPE: type(exc).__name__})
                await asyncio.sleep(min(backoff, max(0.0, budget_end - time.monotonic())))
                backoff = min(backoff * 2, 1.0)
            except InvalidArgument as exc:
                raise FailedPrecondition(f"the target refused a round: {exc}") from exc

    def _observe_round(
        self,
        round_span: tr.Span,
        index: int,
        k: int,
        proposal: Proposal,
        outcome: VerifyOutcome,
        tokens: int,
        timing: RoundTiming,
        *,
        target_only: bool,
        pipeline_hit: bool = False,
    ) -> None:
        """A committed round's numbers: set once on its span (then ended) and counted in the metrics."""
        if round_span.is_recording():
            round_span.set_attributes(
                tr.round_attributes(
                    draft_length=k,
                    draft_tokens=len(proposal),
                    accepted=outcome.accepted,
                    is_bonus=outcome.is_bonus,
                    deferred=outcome.deferred,
                    tokens=tokens,
                    target_only=target_only,
                    draft_ms=timing.draft_ms,
                    verify_ms=timing.verify_ms,
                    overhead_ms=timing.overhead_ms,
                    wall_ms=timing.wall_ms,
                    pipeline_hit=pipeline_hit,
                )
            )
        round_span.end()
        if self.metrics is not None:
            self.metrics.observe_round(
                index=index,
                draft_tokens=len(proposal),
                accepted=outcome.accepted,
                target_only=target_only,
                tokens=tokens,
                draft_ms=timing.draft_ms,
                verify_ms=timing.verify_ms,
                overhead_ms=timing.overhead_ms,
                wall_ms=timing.wall_ms,
            )

    def _close_later(self, sid: str, target_open: bool, draft_open: bool) -> None:
        """Free the session on both services without holding up (or being cancelled with) the request."""

        async def close() -> None:
            peers: Sequence[TargetPeer | DraftPeer | None] = [
                self.target if target_open else None,
                self.draft if draft_open else None,
            ]
            for peer in peers:
                if peer is None:
                    continue
                try:
                    await peer.close_session(sid, timeout=2.0)
                except Exception as exc:  # noqa: BLE001 - the peer's idle expiry frees it anyway
                    log.debug("closing session %s failed: %s", sid, exc)

        task = asyncio.get_running_loop().create_task(close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
