"""Pipelining strategies: draft round r+1 while the target verifies round r.

A strategy owns the pre-draft state of one request. Each round the loop

1. asks `defers_bonus(round)`: should the target leave the bonus position
   to the next round's first draft token (PEARL post-verify)?
2. sends the verify, then calls `launch(round)`: the strategy may start any
   number of pre-drafts, each with `round.draft_after(extension, k)` for a
   hypothetical outcome of this round, i.e. the tokens `extension` it assumes
   this round commits (j accepted draft tokens, then a recovered or bonus
   token t, or nothing when the bonus is deferred);
3. after the verdict (or a failure: None), awaits `settle(verdict)`, which
   returns the pre-drafts that finished, each as a `PreDraft`.

A strategy whose pre-drafts assume a recovered or bonus token (bonus-match,
the speculation cache) also hands them to `round.stage` as soon as they are
ready: if the verify is still out, the loop stages them at the target, which
verifies the one its own verdict names in its next pass, without waiting for
the coordinator (the loop then uses that staged verdict as the next round's).

The loop, not the strategy, picks the next round's drafts: the first
pre-draft whose extension equals what the round really committed, token for
token. Any other pre-draft was drafted for a prefix that is not the committed
prefix and is discarded, never verified (ARCHITECTURE §3): a strategy cannot
bend the output whatever it launches. Coins are (seed, position, role), so a
draft made early for the right prefix is the draft that would be made now.

`draft_after` calls on one session run one at a time, in call order (the
draft holds one sequence per session), so B of them cost B drafts.
`draft_branches` is the one call for many outcomes: the draft picks the
likeliest verdicts by its own distribution and the measured acceptance, and
drafts all of them in one batched pass (SpecCache, specd.core.draft.branching).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specd.core.errors import InvalidArgument
from specd.core.rounds.adaptive import PositionAcceptance
from specd.core.rounds.branch_budget import BranchBudgets
from specd.core.rounds.steps import DEFAULT_BRANCH_BUDGET, MAX_BRANCH_BUDGET, VerifyOutcome
from specd.core.sampling.proposal import Proposal


class DraftAfter(Protocol):
    """k draft tokens after the round's committed prefix + extension; an empty proposal if the draft failed.
    guess_bonus: the first token is a guess of the target's bonus (steps.ProposeRequest)."""

    def __call__(self, extension: Sequence[int], k: int, *, guess_bonus: bool = False) -> Awaitable[Proposal]: ...


# (budget, acceptance per draft position, k): up to `budget` verdicts of this round's proposal, chosen
# by the draft, with k draft tokens after each, as pre-drafts; none if the draft failed.
DraftBranches = Callable[[int, Sequence[float], int], Awaitable["list[PreDraft]"]]


@dataclass(frozen=True)
class PipelineRound:
    """What a strategy sees of the round being verified."""

    committed: Sequence[int]  # the committed prefix before this round (do not modify)
    proposal: Proposal  # draft tokens the target is verifying now
    budget: int  # draft tokens the round asked for (len(proposal) < budget: the draft ran short)
    next_k: int  # draft tokens the next round is expected to want
    draft_after: DraftAfter
    draft_branches: DraftBranches
    # Hand pre-drafts to the loop as soon as they are ready: while this round's verify is still
    # out, it stages them at the target (TargetPort.stage), which then starts the next round
    # itself when its verdict is one of theirs. For pre-drafts whose extension ends with the
    # round's recovered or bonus token (not a deferred bonus's).
    stage: Callable[[Sequence[PreDraft]], None] = lambda pre_drafts: None
    # The request's opening round: the target prefills the prompt with no draft tokens while the draft
    # prefills beside it (BonusMatch pre-drafts after its guess of the first token: RequestRun._opens_beside)
    opening: bool = False
    # room(n): draft tokens the next round may ask for once this round commits n more tokens (its budget
    # at the request's end or the context's); None: next_k whatever n
    room: Callable[[int], int] | None = None

    def next_budget(self, committed: int) -> int:
        """The next round's draft budget after this round commits `committed` more tokens."""
        return self.next_k if self.room is None else min(self.next_k, self.room(committed))


@dataclass(frozen=True)
class PreDraft:
    extension: tuple[int, ...]  # tokens it assumes this round commits (after the committed prefix)
    proposal: Proposal  # the next round's draft tokens for that prefix


class PipelineStrategy(Protocol):
    name: str

    def defers_bonus(self, rnd: PipelineRound) -> bool: ...

    def launch(self, rnd: PipelineRound) -> int:
        """Start pre-drafts for this round's outcomes; returns how many."""
        ...

    @property
    def pre_draft_ms(self) -> float | None:
        """The last round's pre-draft call: out (beside the verify) -> answer, in ms; None: none answered."""
        ...

    async def settle(self, verdict: VerifyOutcome | None) -> list[PreDraft]:
        """The finished pre-drafts. verdict None: the round failed or was cancelled; cancel them, return none."""
        ...


class Off:
    """No pipelining: the next round drafts after its verdict."""

    name = "off"

    def defers_bonus(self, rnd: PipelineRound) -> bool:
        return False

    def launch(self, rnd: PipelineRound) -> int:
        return 0

    async def settle(self, verdict: VerifyOutcome | None) -> list[PreDraft]:
        return []

    @property
    def pre_draft_ms(self) -> float | None:
        return None


class _TimedPreDraft:
    """A strategy's last pre-draft call: when it went out (beside the verify) and how long it took."""

    def __init__(self) -> None:
        self._sent_at = 0.0  # perf_counter() when the call went out
        self._replied_ms: float | None = None  # its latency, once it answered with drafts

    @property
    def pre_draft_ms(self) -> float | None:
        return self._replied_ms

    def _sent(self) -> None:
        self._sent_at = time.perf_counter()

    def _answered(self) -> None:
        self._replied_ms = (time.perf_counter() - self._sent_at) * 1e3


class _AllAccepted(_TimedPreDraft):
    """One pre-draft, after the prefix with every draft token of this round accepted.

    Only for a full proposal (a draft that ran short is unlikely to be all accepted
    and has nothing more to say). The draft is busy with the pre-draft either way,
    so settle waits for it even when the verdict already rules it out.
    """

    name = ""
    extra = 0  # draft tokens beyond next_k

    def __init__(self) -> None:
        super().__init__()
        self._task: asyncio.Task[Proposal] | None = None
        self._assumed: tuple[int, ...] = ()

    def _applies(self, rnd: PipelineRound) -> bool:
        """A full proposal, and a next round with drafts to ask for after it is all accepted. At the request's
        end there is none: post-verify deferred the bonus there and then ran a ~10 ms target-only round for
        the one token left (emulated h100-8b, agreement 0.95, T = 0: in every 48-token postverify-4 request)."""
        return 0 < len(rnd.proposal) == rnd.budget and self._next_k(rnd) > 0

    def _next_k(self, rnd: PipelineRound) -> int:
        """Draft tokens the round after an all-accepted verdict asks for (bonus-match's guess commits one more)."""
        return rnd.next_budget(len(rnd.proposal) + self.extra)

    def launch(self, rnd: PipelineRound) -> int:
        self._replied_ms = None
        if not self._applies(rnd):
            return 0
        self._assumed = tuple(rnd.proposal.token_ids)
        self._sent()
        self._task = asyncio.ensure_future(self._pre_draft(rnd))
        return 1

    async def _pre_draft(self, rnd: PipelineRound) -> Proposal:
        # bonus-match's first token guesses the bonus: drawn with the target's coin where the draft can
        pre = await rnd.draft_after(self._assumed, self._next_k(rnd) + self.extra, guess_bonus=self.extra > 0)
        if len(pre):  # an empty answer: the draft failed
            self._answered()
        rnd.stage(self._shape(pre))  # post-verify's: staged as the deferred verdict's (StagedRound.deferred)
        return pre

    async def settle(self, verdict: VerifyOutcome | None) -> list[PreDraft]:
        task, self._task = self._task, None
        if task is None:
            return []
        if verdict is None:  # the request is ending: do not wait for a draft nobody will use
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return []
        try:
            pre = await task
        finally:
            task.cancel()  # no-op once done; a request cancelled meanwhile cancels its pre-draft
        return self._shape(pre)

    def _shape(self, pre: Proposal) -> list[PreDraft]:
        raise NotImplementedError


class BonusMatch(_AllAccepted):
    """Pre-draft K+1 tokens after all K accepted; the first is a guess of the bonus token.

    Hit: every draft accepted and the target's bonus equals the guess; the next
    round verifies the other K at once, with no draft latency. In a request's
    opening round (no draft tokens: the target prefills the prompt alone) the
    guess is of the first token, and the pre-draft call opens the draft's
    session beside the target's prefill.
    """

    name = "bonus-match"
    extra = 1

    def _applies(self, rnd: PipelineRound) -> bool:
        return super()._applies(rnd) or (rnd.opening and len(rnd.proposal) == rnd.budget == 0 < rnd.next_k)

    def defers_bonus(self, rnd: PipelineRound) -> bool:
        return False

    def _shape(self, pre: Proposal) -> list[PreDraft]:
        if len(pre) < 2:
            return []
        return [PreDraft(self._assumed + (pre.token_ids[0],), pre.window(1))]


class PostVerify(_AllAccepted):
    """Pre-draft K tokens after all K accepted and ask the target to defer the bonus (PEARL).

    Hit: every draft accepted; the next round's first draft token is verified at the
    bonus position against the p the target already computed (an accept or recover
    coin there instead of a bonus coin, never both: exact).
    """

    name = "post-verify"

    def defers_bonus(self, rnd: PipelineRound) -> bool:
        return self._applies(rnd)

    def _shape(self, pre: Proposal) -> list[PreDraft]:
        if len(pre) < 1:
            return []
        return [PreDraft(self._assumed, pre.window(0))]


class SpecCache(_TimedPreDraft):
    """A speculation cache (SSD / Saguaro): pre-draft the next round for the likeliest verdicts.

    While the target verifies, one branch call has the draft choose up to
    `budget` verdicts (j, t) of this round's proposal, the all-accepted one
    with its best bonus guesses and j accepted with its best recovered guesses,
    by P(exactly j accepted) x P(t | j) (specd.core.draft.branching), and draft the
    next round after each in one batched pass. Hit: the verdict is one of them;
    the next round verifies that branch's drafts at once.

    P(exactly j accepted) comes from this request's verdicts per position
    (`PositionAcceptance`); the draft supplies P(t | j). A drafter with no
    distribution (n-gram, suffix) covers the all-accepted verdict with its
    own bonus guess, as bonus-match does. A hit gives the very tokens a fresh
    draft would (the draft's coins are (seed, position)), so the output is the
    same as without pipelining, greedy and seeded.
    """

    name = "spec-cache"

    def __init__(
        self, budget: int = DEFAULT_BRANCH_BUDGET, budgets: BranchBudgets | None = None, greedy: bool = True
    ) -> None:
        if not 1 <= budget <= MAX_BRANCH_BUDGET:
            raise InvalidArgument(f"the branch budget must be in 1..{MAX_BRANCH_BUDGET}, got {budget}")
        super().__init__()
        self.budget = budget  # the most branches a call asks for; `budgets` may choose fewer per round
        self.acceptance = PositionAcceptance()
        self._budgets = budgets  # the service's measurements (specd.core.rounds.branch_budget); None: always `budget`
        self._greedy = greedy
        self._task: asyncio.Task[list[PreDraft]] | None = None
        self._drafted = 0  # draft tokens of the round whose verdict settle will see
        self._asked = 0  # branches the round's call asked for
        self._round: PipelineRound | None = None  # the round whose verdict settle will see

    def defers_bonus(self, rnd: PipelineRound) -> bool:
        return False

    def launch(self, rnd: PipelineRound) -> int:
        """One branch call; returns its budget (the draft decides how many of them it drafts)."""
        self._drafted, self._replied_ms, self._round = len(rnd.proposal), None, rnd
        if not self._drafted or rnd.next_k <= 0:
            return 0
        rates = self.acceptance.rates(self._drafted)
        cls = self._budgets.workload(self._greedy, self._drafted) if self._budgets is not None else None
        self._asked = cls.choose(self.budget) if cls is not None else self.budget
        self._sent()
        self._task = asyncio.ensure_future(self._branches(rnd, rates, self._asked))
        return self._asked

    async def _branches(self, rnd: PipelineRound, rates: Sequence[float], budget: int) -> list[PreDraft]:
        pre_drafts = await rnd.draft_branches(budget, rates, rnd.next_k)
        if pre_drafts:  # none: the draft failed or had no room
            self._answered()
        rnd.stage(pre_drafts)
        return pre_drafts

    async def settle(self, verdict: VerifyOutcome | None) -> list[PreDraft]:
        verify_ms = (time.perf_counter() - self._sent_at) * 1e3
        if verdict is not None and self._drafted:
            self.acceptance.observe(self._drafted, verdict.accepted)
        task, self._task = self._task, None
        if task is None:
            return []
        # The request is ending, or its verdict leaves the next round nothing to draft (the request's last
        # round, every draft accepted): do not wait for branches nobody will use.
        if (
            verdict is None
            or self._round is None
            or self._round.next_budget(verdict.accepted + (0 if verdict.deferred else 1)) <= 0
        ):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return []
        try:
            pre_drafts = await task
        finally:
            task.cancel()  # no-op once done; a request cancelled meanwhile cancels its branch call
        self._measured(verdict, verify_ms, pre_drafts)
        return pre_drafts

    def _measured(self, verdict: VerifyOutcome, verify_ms: float, pre_drafts: list[PreDraft]) -> None:
        """The round's latencies and which branch held its verdict, to the service's budget measurements."""
        if self._budgets is None:
            return
        branches = [(len(p.extension) - 1, p.extension[-1]) for p in pre_drafts if p.extension]
        held = None if verdict.deferred else (verdict.accepted, verdict.token_id)
        cls = self._budgets.workload(self._greedy, self._drafted)
        cls.observe(self._asked, verify_ms, self._replied_ms, branches, held, self._drafted)


@dataclass(frozen=True)
class PipelineSettings:
    """What strategies are built with (the coordinator's settings)."""

    branch_budget: int = DEFAULT_BRANCH_BUDGET  # spec-cache: the most branches per round
    budgets: BranchBudgets | None = None  # spec-cache: the service's budget measurements (None: always the most)
    greedy: bool = True  # the request's sampling (its budget's workload class)


# Name (as requests and the coordinator's --pipeline say it) -> a factory of fresh strategies.
PIPELINES: dict[str, Callable[[PipelineSettings], PipelineStrategy]] = {
    Off.name: lambda _: Off(),
    BonusMatch.name: lambda _: BonusMatch(),
    PostVerify.name: lambda _: PostVerify(),
    SpecCache.name: lambda settings: SpecCache(settings.branch_budget, settings.budgets, settings.greedy),
}


# What `--pipeline auto` chooses among per round (specd.core.rounds.auto); the first is where it starts.
AUTO_PIPELINES = (Off.name, SpecCache.name, PostVerify.name, BonusMatch.name)


def make_pipeline(name: str, settings: PipelineSettings | None = None) -> PipelineStrategy:
    """A fresh strategy (it holds one request's pre-draft state)."""
    try:
        factory = PIPELINES[name]
    except KeyError:
        raise InvalidArgument(f"unknown pipeline {name!r}; use one of {sorted(PIPELINES)}") from None
    return factory(settings or PipelineSettings())
