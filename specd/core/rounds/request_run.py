"""One request's rounds (`RequestRun`): the body of the round loop (specd.core.rounds.loop).

Per round: choose K (fixed, or auto's arm), take the draft tokens (a pre-draft made for exactly
this prefix, staged at the target or not, or a fresh propose), send them to the target while the
pipeline strategy pre-drafts the next round (and stages its pre-drafts at the target while the
verify is out), commit the verdict, apply the stop rules, and emit one `RoundRecord`. What is
shared by every request of a service (auto's measurements, the draft's health, background
closes) is the `RoundService` (the RoundLoop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from specd.core.errors import REQUEST_ERRORS, DeadlineExceeded, ProposalRefused, ResourceExhausted, SpecdError
from specd.core.rounds.auto import PIPELINE_AUTO, Arm, ArmCycles, AutoChooser, AutoPolicy
from specd.core.rounds.branch_budget import BranchBudgets
from specd.core.rounds.generation import FinishReason, Generation, StopRule
from specd.core.rounds.pipeline import (
    AUTO_PIPELINES,
    BonusMatch,
    Off,
    PipelineRound,
    PipelineSettings,
    PipelineStrategy,
    PostVerify,
    PreDraft,
    make_pipeline,
)
from specd.core.rounds.port_sessions import DraftSession, TargetSession
from specd.core.rounds.ports import Carrier, DraftPort, RoundObserver, TargetPort
from specd.core.rounds.record import PipelineHit, RoundRecord, RoundStats, TargetOnly, TokenKind
from specd.core.rounds.spec import GenerateSpec, LoopSettings
from specd.core.rounds.steps import StagedOutcome, StagedRound, VerifyOutcome
from specd.core.rounds.tree_rounds import StopCheck, TreeRounds, check_tree_request
from specd.core.sampling.proposal import Proposal

log = logging.getLogger(__name__)

# Draft errors that are about one request: its own error, or no room for it (a full draft sheds it).
_REFUSALS: tuple[type[SpecdError], ...] = (*REQUEST_ERRORS, ResourceExhausted)
T = TypeVar("T")


class RoundService(Protocol):
    """What a request's rounds share with the service's other requests (the RoundLoop)."""

    target: TargetPort
    draft: DraftPort | None
    settings: LoopSettings
    auto: AutoPolicy
    branch_budgets: BranchBudgets
    running: int  # requests whose rounds are running (auto's workload class)

    async def draft_usable(self) -> bool: ...

    def draft_failed(self, exc: BaseException) -> None: ...

    def close_later(
        self,
        target: TargetSession | None,
        draft: DraftSession | None,
        committed: Sequence[int] = (),
        *,
        abandoned: bool = False,
    ) -> None: ...


@dataclass(frozen=True)
class _Ready:
    """A pre-draft made for exactly the committed prefix, and the target's staged verify of it, if any.

    Staged: proposal is the very window staged (budget and cut applied then), which the next
    round verifies whatever it would choose now: the target runs it as soon as its verdict
    names it, so another choice would only waste that pass."""

    proposal: Proposal
    hit: PipelineHit
    staged: asyncio.Future[StagedOutcome] | None = None  # the stage holding it (TargetPort.stage)
    candidate: int = -1  # its index among that stage's candidates
    defer_bonus: bool = False  # staged: its verify defers the bonus (as the round would: StagedRound.defer_bonus)


class RequestRun:
    """One request's rounds: iterate `rounds()`, then read `generation` and `stats`."""

    def __init__(
        self,
        loop: RoundService,
        spec: GenerateSpec,
        max_context: int,
        session_id: str,
        deadline: float,
        stop: StopCheck | None,
        observer: RoundObserver,
    ) -> None:
        spec.params.validate()
        self.spec = spec
        self.session_id = session_id
        self.generation = Generation(spec.prompt_ids, StopRule(spec.max_new_tokens, max_context, spec.stop_token_ids))
        self.stats = RoundStats()
        self._loop = loop
        self._deadline = deadline
        self._stop = stop
        self._observer = observer
        speculating = spec.speculation != "off"
        self._pipeline_settings = PipelineSettings(
            branch_budget=loop.settings.branch_budget,
            budgets=loop.branch_budgets if loop.settings.adapt_branch_budget else None,
            greedy=spec.params.is_greedy,
        )
        self._strategies: dict[str, PipelineStrategy] = {}  # by name: each holds this request's pre-draft state
        auto_pipeline = spec.pipeline == PIPELINE_AUTO
        self._chooser: AutoChooser | None = None
        self._cuts = speculating and spec.speculation == "auto" and not spec.seeded
        if speculating and (spec.speculation == "auto" or auto_pipeline):
            fixed = spec.speculation == "fixed" or spec.seeded
            self._chooser = loop.auto.chooser(
                spec.draft_length,
                AUTO_PIPELINES if auto_pipeline else (spec.pipeline,),
                target_only=not fixed,
                k_min=spec.draft_length if fixed else 1,
                shadow=True,
            )
        self._pipeline = self._strategy(spec.pipeline if speculating and not auto_pipeline else Off.name)
        self._last_send: tuple[Arm, float, ArmCycles] | None = None  # the previous auto round's arm and verify time
        self._all_in = False  # the previous round accepted every draft token it verified
        self._verified_at = 0.0  # perf_counter() when the last verify call answered
        self._target = TargetSession(loop.target, session_id, spec.params, loop.settings.target_timeout_s)
        self._draft = (
            # only auto reads the draft tokens' confidence (its cut and calibration): a fixed request spares it
            DraftSession(loop.draft, session_id, spec.params, spec.tenant, confidence=self._chooser is not None)
            if loop.draft is not None
            else None
        )
        self._ready: _Ready | None = None  # a pre-draft for the committed prefix
        self._verifying: asyncio.Future[Any] | None = None  # this round's verify while it is out (pipelined)
        self._used_staged = False  # this round's verdict is the one the previous round staged
        self._draft_refused = False  # the draft refused this request alone: target-only rounds for it
        self._draft_opened = False  # a draft call answered: the draft holds this request's prefix (no prefill left)
        self._opened_with: Arm | None = None  # auto's arm for an opening beside, which the next round runs
        # A shadow guess in flight (AutoChooser.choose): the position of the token it guesses, its class, its call.
        self._shadow: tuple[int, ArmCycles, asyncio.Future[Proposal | TargetOnly]] | None = None
        self._tree: TreeRounds | None = None  # a tree request's rounds (specd.core.rounds.tree_rounds)
        if speculating and spec.tree_budget > 0:
            check_tree_request(spec.tree_budget, spec.speculation, spec.pipeline, spec.draft_length)
            self._tree = TreeRounds(
                self.generation, spec.tree_budget, spec.draft_length, self._target, self._draft,
                loop.draft_usable, self._draft_call, self._target_retry, stop, deadline, spec.pipeline,
            )  # fmt: skip

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.generation.finish_reason

    async def rounds(self) -> AsyncGenerator[RoundRecord, None]:
        """Run rounds until the request stops, yielding each round's record as it commits."""
        self._loop.running += 1
        try:
            while not self.generation.done:
                try:
                    record = await self._round()
                except BaseException as exc:
                    self._observer.round_failed(exc)
                    raise
                yield record
        finally:
            self._loop.running -= 1
            if self._chooser is not None:
                self._chooser.finish()
            if self._ready is not None and self._ready.staged is not None:
                _drop(self._ready.staged)
            if self._shadow is not None:  # its message is out: the draft answers it before the close
                _drop(self._shadow[2])
                self._shadow = None
            self._loop.close_later(
                self._target, self._draft, list(self.generation.committed), abandoned=not self.generation.done
            )

    # ---- one round ------------------------------------------------------------------

    async def _round(self) -> RoundRecord:
        gen = self.generation
        t0 = time.perf_counter()
        index, committed = self.stats.rounds, gen.committed
        carrier = self._observer.round_started(index, len(committed))
        if self._tree is not None:
            return self._recorded(await self._tree.round(index, carrier))
        arm, cls = self._choose()
        if cls is not None and self._chooser is not None and self._chooser.shadow_due:
            self._guess_beside(committed, cls, carrier)
        wanted, why = self._wanted(arm)
        budget = gen.draft_budget(wanted)
        if why is None and budget == 0:
            why = TargetOnly.BUDGET
        proposal, hit = Proposal([]), None
        draft_wall_ms = 0.0  # how long this round waited for a draft call (0: pipelined, or none made)
        prefilled = True  # no fresh draft call, or one to a draft that already held the prefix
        ready, self._ready = self._ready, None
        pipeline = self._pipeline  # this round's strategy (the opening's may differ: _opens_beside)
        # The previous round staged this round's verify at the target, which verifies it as soon as its
        # verdict names it: the round is that window (its budget and cut applied when it was staged).
        staged = ready if ready is not None and ready.staged is not None else None
        if staged is not None:
            proposal, hit, budget, why = staged.proposal, staged.hit, len(staged.proposal), None
        elif budget > 0:
            if ready is not None:
                # The round verifies the pre-draft's window: that is its K (as a staged one's). One shorter
                # than the arm's K (the previous round's arm drafted fewer: an exploration to K + 1) left
                # bonus-match and post-verify no full proposal to pre-draft after, so the next round
                # drafted afresh, and that miss was measured as the arm's (emulated h100-8b, agreement
                # 0.95, T = 0: a K = 3 -> 4 switch read as bonus-match 4 missing with every draft accepted).
                proposal, hit = ready.proposal.window(0, budget), ready.hit
                budget = len(proposal)
            elif self._draft is None:
                why = TargetOnly.NO_DRAFT
            elif not await self._loop.draft_usable():
                why = TargetOnly.DRAFT_UNAVAILABLE
            elif index == 0 and self._opens_beside(wanted):
                why, budget, pipeline = TargetOnly.OPENING, 0, self._strategy(BonusMatch.name)
                # The opening verifies none of the arm's drafts: the next round does (a probe that got
                # no verdict learnt nothing, and the next choice, still without one, held target-only).
                self._opened_with = arm
            else:
                prefilled = self._draft_opened  # else this call's wall carries the draft's prefill
                t_draft = time.perf_counter()
                proposal, why = await self._propose(committed, (), budget, carrier)
                draft_wall_ms = (time.perf_counter() - t_draft) * 1e3

        drafted = len(proposal)  # before auto cuts it: what the draft call drafted
        if staged is None:
            proposal = self._cut(arm, cls, proposal)

        async def draft_after(extension: Sequence[int], k: int, *, guess_bonus: bool = False) -> Proposal:
            return (await self._propose(committed, extension, k, carrier, guess_bonus=guess_bonus))[0]

        async def draft_branches(branches: int, acceptance: Sequence[float], k: int) -> list[PreDraft]:
            pending = tuple(proposal.token_ids)
            result = await self._draft_call(
                lambda draft, timeout: draft.propose_branches(
                    committed, pending, k, budget=branches, acceptance=acceptance, timeout=timeout, carrier=carrier
                )
            )
            if isinstance(result, TargetOnly):
                return []
            return [PreDraft(b.extension(pending), b.proposal) for b in result.branches]

        stages: list[tuple[asyncio.Future[StagedOutcome], dict[tuple[int, ...], tuple[int, Proposal, bool]]]] = []
        prefix_length = len(committed)

        def stage(pre_drafts: Sequence[PreDraft]) -> None:
            """Stage the next round's verify for these pre-drafts, if this round's verify is still out."""
            if stages or self._verifying is None or self._verifying.done():
                return
            candidates: list[StagedRound] = []
            index: dict[tuple[int, ...], tuple[int, Proposal, bool]] = {}  # extension -> (candidate, window, defers)
            drafts = tuple(proposal.token_ids)
            most = len(drafts) - 1 if defer_bonus else len(drafts)  # accepted before a token (no bonus if deferred)
            for pre in pre_drafts:
                ext = pre.extension
                deferred = defer_bonus and ext == drafts  # all accepted, no bonus: post-verify's pre-draft
                j = len(ext) if deferred else len(ext) - 1
                if ext in index or not (deferred or (0 <= j <= most and drafts[:j] == ext[:j])):
                    continue
                # what the next round would verify of it: its budget after this verdict, and auto's cut
                window = self._cut(arm, cls, pre.proposal.window(0, gen.draft_budget(wanted, after=len(ext))))
                if len(window):
                    # The staged round defers its bonus where that round, verified from here, would: a round
                    # staged or not commits the same tokens, so the output does not depend on timing.
                    defers = (
                        self._next_pipeline() == PostVerify.name
                        and gen.draft_budget(wanted, after=len(ext) + len(window)) > 0
                    )
                    index[ext] = (len(candidates), window, defers)
                    candidates.append(StagedRound(j, -1 if deferred else ext[-1], window, deferred, defers))
            if candidates:
                staging = self._target.stage(prefix_length, candidates, deadline=self._deadline, carrier=carrier)
                stages.append((asyncio.ensure_future(staging), index))

        opening = why is TargetOnly.OPENING
        rnd = PipelineRound(
            committed,
            proposal,
            budget,
            wanted,
            draft_after,
            draft_branches,
            stage,
            opening,
            lambda more: gen.draft_budget(wanted, after=more),
        )
        defer_bonus = staged.defer_bonus if staged is not None else pipeline.defers_bonus(rnd)
        if arm is not None and cls is not None:
            self._cycle(arm, cls, budget, why, draft_wall_ms, hit is not None, first=index == 0, prefilled=prefilled)
        t_verify = time.perf_counter()
        if staged is not None:
            verify = self._staged_verify(staged, committed, proposal, carrier)
        else:
            verify = self._verify(committed, proposal, defer_bonus, carrier)
        pre_drafts: list[PreDraft] = []
        if isinstance(pipeline, Off):  # nothing runs beside the verify: await it here (no task, no loop turn)
            (outcome, refused), launched = await verify, 0
        else:
            (outcome, refused), launched, pre_drafts = await self._verify_beside_pipeline(verify, rnd, pipeline)
        if refused:  # the target refused the draft's proposal: this round ran target-only
            proposal, hit, why = Proposal([]), None, TargetOnly.DRAFT_FAILED
        was_staged, self._used_staged = self._used_staged, False
        self._all_in = len(proposal) > 0 and outcome.accepted >= len(proposal)
        kind = _kind(outcome)
        token = None if outcome.deferred else outcome.token_id
        extension = (*proposal.token_ids[: outcome.accepted], *(() if token is None else (token,)))
        for pre in pre_drafts:  # only a draft for exactly the prefix this round commits
            if pre.extension == extension and len(pre.proposal) > 0:
                pipeline_hit = PipelineHit(pipeline.name, outcome.accepted, kind, launched)
                where = stages[0][1].get(extension) if stages else None
                if where is not None:  # staged: the target verifies it (or says it did not)
                    self._ready = _Ready(where[1], pipeline_hit, stages[0][0], where[0], where[2])
                else:
                    self._ready = _Ready(pre.proposal, pipeline_hit)
                break
        if stages and (self._ready is None or self._ready.staged is not stages[0][0]):
            _drop(stages[0][0])  # none of its candidates is the next round's
        # The opening's verify is the target's prefill, and its pre-draft call the draft's: no arm's costs.
        if arm is not None and cls is not None and self._chooser is not None and not refused and not opening:
            verify_ms = (self._verified_at - t_verify) * 1e3  # auto reads its own walls, not the peers' figures
            self._chooser.observe_round(
                cls,
                arm,
                proposal,
                drafted,
                hit is not None,
                outcome.accepted,
                verify_ms,
                draft_wall_ms if prefilled else 0.0,  # a prefill is no draft's cost
            )
            # a pre-draft the request's end shortened (PipelineRound.room) is not one of `wanted` tokens
            full = rnd.next_budget(len(proposal) + 1) == wanted
            if launched and full and (pre_ms := pipeline.pre_draft_ms) is not None:
                self._chooser.observe_pre_draft(cls, pipeline.name, wanted, pre_ms)
        new = gen.commit(proposal.token_ids, outcome.accepted, token)
        if self._shadow is not None:
            self._settle_shadow()
        if self._stop is not None:
            keep = self._stop(new)
            if keep is not None:
                gen.finish(FinishReason.STOP_STRING, keep=len(gen.generated) - len(new) + keep)
                new = new[:keep]
        record = RoundRecord(
            index=index,
            committed_length=len(committed),
            draft_length=budget,
            draft_token_ids=tuple(proposal.token_ids),
            accepted=outcome.accepted,
            token_id=outcome.token_id,
            token_kind=kind,
            committed=tuple(new),
            wall_ms=(time.perf_counter() - t0) * 1e3,
            draft_ms=proposal.compute_ms,
            verify_ms=outcome.compute_ms,
            target_only=None if len(proposal) else why,
            pipeline_hit=hit,
            pipeline_launched=launched,
            pipeline=pipeline.name,
            draft_transit=proposal.transit,
            verify_transit=outcome.transit,
            staged=was_staged,
        )
        return self._recorded(record)

    def _guess_beside(self, committed: Sequence[int], cls: ArmCycles, carrier: Carrier) -> None:
        """A shadow guess (AutoChooser.choose): the draft's next token after `committed`, asked beside this
        target-only round's verify and never waited for; `_settle_shadow` compares it with the token the
        round commits. At T > 0 drawn at the target's coin (as bonus-match guesses a bonus: a target-only
        round's token is one). One at a time; none while the draft is paused or refused this request."""
        if self._shadow is not None or self._draft is None or self._draft_refused:
            return
        sampled = not self.spec.params.is_greedy

        async def guess() -> Proposal | TargetOnly:
            if not await self._loop.draft_usable():
                return TargetOnly.DRAFT_UNAVAILABLE
            return await self._draft_call(
                lambda draft, timeout: draft.propose(
                    committed, (), 1, timeout=timeout, carrier=carrier, guess_bonus=sampled
                )
            )

        self._shadow = (len(committed), cls, asyncio.ensure_future(guess()))

    def _settle_shadow(self) -> None:
        """The shadow guess, once its call answered and its token is committed: a K = 1 verdict to auto."""
        assert self._shadow is not None
        position, cls, call = self._shadow
        if not call.done():
            return  # the draft is slower than the round: the next rounds look again
        self._shadow = None
        if call.cancelled() or call.exception() is not None or self._chooser is None:
            return
        guess, gen = call.result(), self.generation
        at = position - len(gen.prompt)  # the guessed token's index in gen.generated (no copy of the prefix)
        if isinstance(guess, Proposal) and len(guess) and 0 <= at < len(gen.generated):
            self._chooser.observe_shadow(cls, guess.token_ids[0] == gen.generated[at], guess.confidence)

    def _recorded(self, record: RoundRecord) -> RoundRecord:
        self.stats.add(record)
        self._observer.round_ended(record)
        return record

    async def _verify(
        self, committed: Sequence[int], proposal: Proposal, defer_bonus: bool, carrier: Carrier
    ) -> tuple[VerifyOutcome, bool]:
        """The verdict on `proposal`, and whether the target refused it (a relayed q it found malformed):
        then the verdict is a target-only round's, and speculation pauses like on any draft failure."""
        try:
            outcome = await self._target.verify(
                committed,
                proposal,
                defer_bonus=defer_bonus,
                deadline=self._deadline,
                carrier=carrier,
                on_retry=self._target_retry,
            )
            self._verified_at = time.perf_counter()
            return outcome, False
        except ProposalRefused as exc:
            return await self._refused(committed, carrier, exc, "target refused the draft's proposal")

    async def _refused(
        self, committed: Sequence[int], carrier: Carrier, exc: ProposalRefused, what: str
    ) -> tuple[VerifyOutcome, bool]:
        """The target refused the draft's q: speculation pauses as on any draft failure, the round runs target-only."""
        self._loop.draft_failed(exc)
        self._observer.round_event(f"{what}; target-only round", exc)
        outcome = await self._target.verify(
            committed,
            Proposal([]),
            defer_bonus=False,
            deadline=self._deadline,
            carrier=carrier,
            on_retry=self._target_retry,
        )
        return outcome, True

    async def _staged_verify(
        self, ready: _Ready, committed: Sequence[int], proposal: Proposal, carrier: Carrier
    ) -> tuple[VerifyOutcome, bool]:
        """This round's verdict from the verify the previous round staged; a usual verify if the target ran none.

        The staged verdict is already committed at the target; the loop commits it as any
        verdict. A target that refused the staged proposal's q refused the draft's proposal."""
        assert ready.staged is not None
        try:
            result = await ready.staged
        except ProposalRefused as exc:
            return await self._refused(committed, carrier, exc, "target refused the draft's staged proposal")
        except SpecdError as exc:  # the stage failed: verify as usual
            log.debug("a staged verify failed (%s); verifying again", exc)
            result = StagedOutcome.NONE
        if result.candidate == ready.candidate and result.outcome is not None:
            self._verified_at = time.perf_counter()
            self._used_staged = True
            return result.outcome, False
        return await self._verify(committed, proposal, ready.defer_bonus, carrier)

    def _next_pipeline(self) -> str:
        """The pipeline the next round runs as things stand (an opening beside hands over to its arm's)."""
        return self._opened_with.pipeline if self._opened_with is not None else self._pipeline.name

    async def _verify_beside_pipeline(
        self, verify: Coroutine[Any, Any, tuple[VerifyOutcome, bool]], rnd: PipelineRound, pipeline: PipelineStrategy
    ) -> tuple[tuple[VerifyOutcome, bool], int, list[PreDraft]]:
        """The verdict, with the pre-drafts the strategy made while the target verified."""
        task = self._verifying = asyncio.ensure_future(verify)
        launched = pipeline.launch(rnd)  # after the verify: it goes out first
        result: tuple[VerifyOutcome, bool] | None = None
        try:
            result = await task
        finally:
            self._verifying = None
            task.cancel()  # no-op once done; stops the round if the request was cancelled
            pre_drafts = await pipeline.settle(None if result is None or result[1] else result[0])
        assert result is not None  # else the await raised
        return result, launched, pre_drafts

    def _opens_beside(self, wanted: int) -> bool:
        """Whether the opening round prefills the target alone, with the draft's call beside it
        (LoopSettings.opening "beside", and room for a round after it).

        Drafting first makes a request's first token wait for the draft's prefill and
        its K passes before the target's prefill begins: TTFT 40-44 ms against
        target-only's 24-25 (emulated h100-tp2-70b, agreement 0.8, T = 0, speccache-2 and
        auto; 25-26 ms beside). Beside it, the draft's call (its prefill, a guess of the first token
        drawn at the target's coin, K more) runs while the target prefills, and the
        next round uses it when the guess is the target's token (BonusMatch, whatever
        the request's pipeline), staged at the target if it answers in time. A draft
        that costs next to nothing (n-gram, suffix) hides nothing this way and loses
        the K tokens its opening verify would check in the prefill's pass, so the
        coordinator opens beside only for model drafts (--opening auto).
        Exact: a pre-draft is used only for the prefix the verdict commits; and which
        opening runs depends on the setting alone, so every pipeline of a request
        still emits the same tokens for the same seed."""
        return (
            self._loop.settings.opening == "beside"
            and not self._draft_refused
            and self.generation.draft_budget(wanted, after=1) > 0
        )

    def _strategy(self, name: str) -> PipelineStrategy:
        """This request's strategy of that name (made on first use; it keeps its pre-draft state)."""
        strategy = self._strategies.get(name)
        if strategy is None:
            strategy = self._strategies[name] = make_pipeline(name, self._pipeline_settings)
        return strategy

    def _choose(self) -> tuple[Arm | None, ArmCycles | None]:
        """Auto's arm for this round and the workload class it is measured in (None, None: not auto)."""
        if self._chooser is None:
            return None, None
        cls = self._loop.auto.workload(self.spec.params.temperature <= 0, self._loop.running)
        if self._opened_with is not None:  # the round after an opening beside runs the opening's arm
            arm, self._opened_with, self._chooser.shadow_due = self._opened_with, None, False
        else:
            arm = self._chooser.choose(cls)
        self._pipeline = self._strategy(arm.pipeline)
        return arm, cls

    def _cut(self, arm: Arm | None, cls: ArmCycles | None, proposal: Proposal) -> Proposal:
        """The proposal as auto verifies it: cut where its confidence says more tokens stop paying."""
        if self._cuts and arm is not None and cls is not None and self._chooser is not None and proposal.confidence:
            return proposal.cut(self._chooser.cut(cls, arm, proposal.confidence))
        return proposal

    def _wanted(self, arm: Arm | None) -> tuple[int, TargetOnly | None]:
        """K this round would like (before the budget), or 0 and why not."""
        if self.spec.speculation == "off":
            return 0, TargetOnly.SPECULATION_OFF
        if arm is not None:
            return (arm.k, None) if arm.k > 0 else (0, TargetOnly.ADAPTIVE)
        return self.spec.draft_length, None

    def _cycle(
        self,
        arm: Arm,
        cls: ArmCycles,
        budget: int,
        why: TargetOnly | None,
        draft_wall_ms: float,
        hit: bool,
        *,
        first: bool = False,
        prefilled: bool = True,
    ) -> None:
        """At a verify going out: the previous auto round's cycle (its verify out to this one), to its arm,
        with whether this round's drafts were its pipeline's (hit) and its verdict accepted them all.

        It includes this round's wait for its draft, which the previous round's pipeline
        may have saved; a fresh draft of another K is rescaled to the previous arm's K,
        and a round whose K the request's end or the draft's health cut is not measured,
        nor a request's first round (first: its verify carries the target's prefill), nor
        a cycle whose wait for this round's draft carried the draft's prefill (not prefilled:
        the request's first draft call that answered, in its opening round or after target-only
        rounds)."""
        now = time.perf_counter()
        last, self._last_send = self._last_send, None
        normal = why is None or why is TargetOnly.ADAPTIVE
        if last is not None and normal and prefilled:
            prev, sent, prev_cls = last
            cycle_ms = (now - sent) * 1e3
            if draft_wall_ms > 0 and prev.k != budget:  # a fresh draft of another K than prev's
                cycle_ms += draft_wall_ms * ((prev.k / budget if budget else 0.0) - 1.0)
            if prev_cls is cls and (prev.k == 0 or budget > 0):
                assert self._chooser is not None
                self._chooser.observe_cycle(cls, prev, cycle_ms, hit, self._all_in)
        if normal and budget == arm.k and not first:
            self._last_send = (arm, now, cls)

    async def _propose(
        self, committed: Sequence[int], extension: Sequence[int], k: int, carrier: Carrier, *, guess_bonus: bool = False
    ) -> tuple[Proposal, TargetOnly | None]:
        """k draft tokens after committed + extension, or none and why: speculation pauses, output stays exact."""
        result = await self._draft_call(
            lambda draft, timeout: draft.propose(
                committed, extension, k, timeout=timeout, carrier=carrier, guess_bonus=guess_bonus
            )
        )
        if isinstance(result, TargetOnly):
            return Proposal([]), result
        return result, None if len(result) else TargetOnly.DRAFT_EMPTY

    async def _draft_call(self, call: Callable[[DraftSession, float], Awaitable[T]]) -> T | TargetOnly:
        """call(draft session, timeout), or why the draft gave nothing: its failure pauses speculation.

        What says nothing about the draft's health stays this request's: its own deadline
        cutting the call short (a timeout under --draft-timeout-s), or the draft refusing
        or having no room for this request alone. Only the rest pauses every request.
        """
        if self._draft is None:
            return TargetOnly.NO_DRAFT
        if self._draft_refused:
            return TargetOnly.DRAFT_REFUSED
        left = max(0.0, self._deadline - time.monotonic())
        by_deadline = left < self._loop.settings.draft_timeout_s  # the request's deadline, not the draft's limit
        try:
            result = await call(self._draft, min(self._loop.settings.draft_timeout_s, left))
            self._draft_opened = True
            return result
        except DeadlineExceeded as exc:
            if not by_deadline:  # slower than --draft-timeout-s: the draft's problem
                self._loop.draft_failed(exc)
                self._observer.round_event("draft failed; target-only round", exc)
                return TargetOnly.DRAFT_FAILED
            self._observer.round_event("the request's deadline cut the draft short; target-only round", exc)
            return TargetOnly.DRAFT_DEADLINE
        except _REFUSALS as exc:  # this request's own: it alone goes target-only
            self._draft_refused = True
            log.warning(
                "draft refused session %s (%s: %s); target-only for it", self.session_id, type(exc).__name__, exc
            )
            self._observer.round_event("draft refused the request; target-only", exc)
            return TargetOnly.DRAFT_REFUSED
        except SpecdError as exc:  # slow, gone or lying: speculation pauses for every request
            self._loop.draft_failed(exc)
            self._observer.round_event("draft failed; target-only round", exc)
            return TargetOnly.DRAFT_FAILED

    def _target_retry(self, exc: BaseException) -> None:
        log.warning("target round failed (%s: %s); retrying", type(exc).__name__, exc)
        self._observer.round_event("target failed; retrying", exc)


def _drop(future: asyncio.Future[Any]) -> None:
    """A staged verify the loop will not use: cancel waiting for it (its error, if it had one, is read)."""
    if not future.cancel() and not future.cancelled():
        future.exception()


def _kind(outcome: VerifyOutcome) -> TokenKind:
    if outcome.deferred:
        return TokenKind.DEFERRED
    return TokenKind.BONUS if outcome.is_bonus else TokenKind.RECOVERED
