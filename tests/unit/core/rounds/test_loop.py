"""The round loop over scripted ports (tests/loop_fakes.py): asyncio only, no gRPC, no models; seconds.

The fake target is greedy, so every run must give the target's own chain,
token for token, whatever the pipeline, the draft's failures or K; and it
reports any proposal that was not drafted for its committed prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Sequence

import pytest

from specd.core.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, SessionOutOfSync, Unavailable
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.loop import GenerateSpec, LoopSettings, RequestRun, RoundLoop
from specd.core.rounds.pipeline import PIPELINES, PipelineRound, PreDraft
from specd.core.rounds.record import RoundRecord, TargetOnly, TokenKind
from specd.core.rounds.steps import VerifyOutcome
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from tests.loop_fakes import FakeDraft, FakeTarget, Script, Watch, chain, draft_next, fail, target_next

PROMPT = [5, 17, 3, 42]
GREEDY = SamplingParams(temperature=0.0, seed=1)
MAX_CONTEXT = 4096


def spec(n: int = 40, **kw) -> GenerateSpec:
    base = dict(prompt_ids=PROMPT, params=GREEDY, max_new_tokens=n, speculation="fixed", draft_length=3)
    return GenerateSpec(**{**base, **kw})


def expected(n: int = 40) -> list[int]:
    return chain(PROMPT, n, target_next)


def run(
    s: GenerateSpec,
    target: FakeTarget,
    draft: FakeDraft | None,
    *,
    settings: LoopSettings | None = None,
    deadline: float = math.inf,
    stop=None,
    watch: Watch | None = None,
) -> tuple[RequestRun, list[RoundRecord], RoundLoop]:
    async def main() -> tuple[RequestRun, list[RoundRecord], RoundLoop]:
        loop = RoundLoop(target, draft, settings or LoopSettings(draft_retry_s=0.0))
        r = loop.run(s, max_context=MAX_CONTEXT, session_id="s1", deadline=deadline, stop=stop, observer=watch)
        records = [rec async for rec in r.rounds()]
        await loop.drain()
        return r, records, loop

    return asyncio.run(main())


def check_records(r: RequestRun, records: list[RoundRecord]) -> None:
    """The stats are the records added up; the records tile the output."""
    assert [t for rec in records for t in rec.committed] == r.generation.generated
    assert [rec.index for rec in records] == list(range(len(records)))
    s = r.stats
    assert s.rounds == len(records)
    assert s.draft_tokens == sum(rec.draft_tokens for rec in records)
    assert s.accepted_tokens == sum(rec.accepted for rec in records)
    assert s.pipeline_hits == sum(rec.pipeline_hit is not None for rec in records)
    assert s.target_only_rounds == sum(rec.fallback for rec in records)
    assert sum(s.pipeline_hits_by_outcome.values()) == s.pipeline_hits
    assert s.wall_ms == pytest.approx(sum(rec.wall_ms for rec in records))


# ---- every strategy: exact, hits and misses ---------------------------------------------


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize("speculation", ["fixed", "auto"])
def test_every_strategy_gives_the_target_only_output(pipeline: str, speculation: str) -> None:
    # Auto chooses from measured walls: a verify a few times a draft step's wall (as on the hardware
    # speculation is for) keeps it drafting and pipelining when a loaded CI machine wakes the loop
    # late (with both at 1 ms it measured drafting as a loss and went target-only, flakily).
    target = FakeTarget(Script(latency_s=0.005)) if speculation == "auto" else FakeTarget()
    draft = FakeDraft()
    r, records, _ = run(spec(60, pipeline=pipeline, speculation=speculation), target, draft)
    assert r.generation.generated == expected(60) and r.finish_reason == FinishReason.LENGTH
    assert target.violations == []  # nothing drafted for another prefix was ever verified
    assert target.closed == draft.closed == ["s1"]
    assert draft.final["s1"] == PROMPT + expected(60)  # the draft's close carries the whole answer
    check_records(r, records)
    assert r.stats.accepted_tokens > 0
    if pipeline == "off":
        assert r.stats.pipeline_hits == 0 and not any(rec.pipeline_launched for rec in records)
    else:
        launched = [rec for rec in records[:-1] if rec.pipeline_launched]
        assert launched and r.stats.pipeline_hits > 0
        missed = [rec for rec, nxt in itertools.pairwise(records) if rec.pipeline_launched and nxt.pipeline_hit is None]
        assert missed, "the script should make some pre-drafts miss"


def hits_after(records: list[RoundRecord]) -> list[tuple[RoundRecord, RoundRecord]]:
    return [(rec, nxt) for rec, nxt in itertools.pairwise(records) if rec.pipeline_launched]


def test_bonus_match_hits_only_when_every_draft_and_the_guess_are_right() -> None:
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(80, pipeline="bonus-match"), target, draft)
    # its pre-drafts (and only they) ask for a guess of the bonus first (steps.ProposeRequest.guess_bonus)
    assert sum(draft.guess_flags) == sum(rec.pipeline_launched for rec in records) > 0
    assert r.generation.generated == expected(80) and target.violations == []
    kinds = set()
    for rec, nxt in hits_after(records):
        all_in = rec.accepted == rec.draft_tokens
        if nxt.pipeline_hit is not None:
            assert all_in and rec.token_kind == TokenKind.BONUS
            assert nxt.pipeline_hit.outcome == f"{rec.accepted}:bonus" and nxt.draft_ms == 0.0
            kinds.add("hit")
        elif all_in:
            kinds.add("guessed the bonus wrong")
        else:
            kinds.add("rejected")
    assert kinds == {"hit", "guessed the bonus wrong", "rejected"}
    assert set(r.stats.pipeline_hits_by_outcome) == {"3:bonus"}


@pytest.mark.parametrize("pipeline", ["bonus-match", "spec-cache", "post-verify"])
def test_pre_drafts_ready_before_the_verdict_are_staged_and_the_target_verifies_them_itself(pipeline: str) -> None:
    """A pre-draft that lands while its round is still being verified is staged at the target, which verifies
    the one its own verdict names at once: the next round commits that verdict with no verify call of its own.
    The output stays the target's own chain, and a staged candidate the verdict does not name never runs.
    Post-verify's pre-draft assumes a deferred bonus, and its staged round defers its own, as it would
    unstaged (the last round, with no room after it, draws its bonus)."""
    target = FakeTarget(Script(latency_s=0.02))  # the verify outlasts the pre-draft (1 ms a call)
    r, records, _ = run(spec(80, pipeline=pipeline), target, FakeDraft())
    assert r.generation.generated == expected(80) and target.violations == []
    check_records(r, records)
    staged = [rec for rec in records if rec.staged]
    assert target.stages and target.staged_runs > 0 and staged
    assert all(rec.pipeline_hit is not None for rec in staged)  # only a pre-draft's round can be staged
    assert len(staged) <= target.staged_runs  # a staged verdict the loop did not use is rolled back
    for stage in target.stages:  # candidates differ by the verdict they assume
        keys = [(c.accepted, c.token_id) for c in stage.candidates]
        assert len(keys) == len(set(keys))
    hits = [rec for rec in records if rec.pipeline_hit is not None]
    assert len(staged) == len(hits)  # every hit here was staged in time (the verify is the slow side)
    if pipeline == "post-verify":
        assert all(c.deferred for stage in target.stages for c in stage.candidates)
        full = [rec for rec in staged[:-1] if rec.accepted == rec.draft_length]
        assert full and all(rec.token_kind is TokenKind.DEFERRED for rec in full)


def test_a_pre_draft_that_lands_after_the_verdict_is_not_staged() -> None:
    """When the draft is the slow side, the loop knows the verdict first and verifies the hit itself."""
    target = FakeTarget(Script(latency_s=0.001))
    r, records, _ = run(spec(60, pipeline="bonus-match"), target, FakeDraft(Script(latency_s=0.02)))
    assert r.generation.generated == expected(60) and target.violations == []
    assert r.stats.pipeline_hits > 0 and not target.stages and not any(rec.staged for rec in records)


def test_post_verify_defers_the_bonus_and_verifies_the_pre_draft_in_its_place() -> None:
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(80, pipeline="post-verify"), target, draft)
    assert r.generation.generated == expected(80) and target.violations == []
    assert not any(draft.guess_flags)  # its pre-draft's first token is a draft token, drawn as any
    deferred = [rec for rec in records if rec.token_kind == TokenKind.DEFERRED]
    assert deferred and all(rec.token_id == -1 and rec.accepted == rec.draft_tokens for rec in deferred)
    for rec, nxt in hits_after(records):
        if nxt.draft_length:  # (the last rounds may have no room for a draft)
            assert (nxt.pipeline_hit is not None) == (rec.token_kind == TokenKind.DEFERRED)
    assert set(r.stats.pipeline_hits_by_outcome) == {"3:deferred"}
    assert any(rec.token_kind == TokenKind.RECOVERED for rec, _ in hits_after(records))  # misses happen too


@pytest.mark.parametrize("pipeline", ["post-verify", "bonus-match"])
@pytest.mark.parametrize("n", [13, 14, 15, 16])
def test_a_pipeline_that_needs_every_draft_accepted_pre_drafts_nothing_past_the_requests_end(
    pipeline: str, n: int
) -> None:
    """With a draft that is always right, a request runs no more target-only rounds at its end than without a
    pipeline: post-verify defers no bonus where the round after it would have nothing to draft (it then ran
    a target-only round for the one token left), and neither strategy pre-drafts for a round with no draft
    budget. (Post-verify's rounds commit K tokens, not K + 1: it takes more rounds, each without a draft wait.)"""

    def rounds(pipe: str) -> list[RoundRecord]:
        target = FakeTarget(draft=target_next)
        r, records, _ = run(spec(n, pipeline=pipe), target, FakeDraft(step=target_next))
        assert r.generation.generated == expected(n) and target.violations == []
        check_records(r, records)
        return records

    plain, records = rounds("off"), rounds(pipeline)
    budget = [rec for rec in records if rec.target_only is TargetOnly.BUDGET]
    assert len(budget) <= sum(rec.target_only is TargetOnly.BUDGET for rec in plain) <= 1
    for rec, nxt in itertools.pairwise(records):
        if rec.pipeline_launched:
            assert nxt.pipeline_hit is not None and nxt.draft_length > 0  # every pre-draft was used
    assert records[-1].token_kind == TokenKind.BONUS and not records[-1].pipeline_launched


class GuessFirstRejected:
    """A several-outcome strategy (the shape of a speculation cache): besides the all-accepted pre-draft,
    one for "the first draft token is rejected and the target says t", for a right and a wrong t."""

    name = "guess-test"

    def __init__(self) -> None:
        self.tasks: list[tuple[tuple[int, ...], asyncio.Task[Proposal]]] = []

    def defers_bonus(self, rnd: PipelineRound) -> bool:
        return False

    def launch(self, rnd: PipelineRound) -> int:
        if not len(rnd.proposal):
            return 0
        right = target_next(rnd.committed)  # the test knows the target
        drafts = tuple(rnd.proposal.token_ids)
        guesses = [(right,), ((right + 1) % 61,), (*drafts, draft_next([*rnd.committed, *drafts]))]
        for ext in guesses:
            self.tasks.append((ext, asyncio.ensure_future(rnd.draft_after(ext, rnd.next_k))))
        return len(guesses)

    async def settle(self, verdict: VerifyOutcome | None) -> list[PreDraft]:
        tasks, self.tasks = self.tasks, []
        out = [PreDraft(ext, await task) for ext, task in tasks]
        return [] if verdict is None else out


def test_a_strategy_with_several_outcomes_plugs_in_and_wrong_guesses_are_never_verified(monkeypatch) -> None:
    monkeypatch.setitem(PIPELINES, "guess-test", lambda _: GuessFirstRejected())
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(80, pipeline="guess-test"), target, draft)
    assert r.generation.generated == expected(80) and target.violations == []
    outcomes = r.stats.pipeline_hits_by_outcome
    assert outcomes["0:recovered"] > 0  # the first-rejected guess hits ...
    assert set(outcomes) <= {"0:recovered"} | {f"{k}:bonus" for k in range(1, 4)}  # ... and nothing else can
    assert all(rec.pipeline_launched in (0, 3) for rec in records)
    check_records(r, records)


# ---- the draft failing: target-only rounds, still exact --------------------------------------


@pytest.mark.parametrize("pipeline", ["off", "bonus-match", "post-verify", "spec-cache"])
def test_draft_failures_fall_back_to_target_only_rounds(pipeline: str) -> None:
    # call 2 fails; calls 5 and 6 lose the session (twice in a row: a failure); call 8 lies (K+1 tokens)
    script = Script(fail=fail(2) | fail(5, SessionOutOfSync("x")) | fail(6, SessionOutOfSync("y")))
    draft, target, watch = FakeDraft(script, lie={8}), FakeTarget(), Watch()
    r, records, _ = run(spec(60, pipeline=pipeline), target, draft, watch=watch)
    assert r.generation.generated == expected(60) and target.violations == []
    assert watch.events.count(("draft failed; target-only round", "Unavailable")) == 3
    failed = [rec for rec in records if rec.target_only == TargetOnly.DRAFT_FAILED]
    assert all(rec.fallback and rec.draft_tokens == 0 for rec in failed)
    if pipeline == "off":  # (pipelined, some failures hit a pre-draft: the next round just drafts afresh)
        assert [rec.index for rec in failed] == [1, 4, 6]
    assert draft.opens >= 3  # a failure forgets the draft's sequence: it is re-opened from the committed tokens
    assert any(rec.draft_tokens for rec in records[-5:])  # speculation came back
    check_records(r, records)


def test_a_failed_draft_pauses_speculation_for_every_request() -> None:
    draft = FakeDraft(Script(fail=fail(2)))
    r, records, loop = run(spec(20), FakeTarget(), draft, settings=LoopSettings(draft_retry_s=60.0))
    assert r.generation.generated == expected(20)
    reasons = [rec.target_only for rec in records]
    assert reasons[1] == TargetOnly.DRAFT_FAILED
    assert set(reasons[2:-1]) == {TargetOnly.DRAFT_UNAVAILABLE} and reasons[-1] == TargetOnly.BUDGET
    assert asyncio.run(loop.draft_usable()) is False


def test_a_draft_refusing_one_request_leaves_the_others_speculating() -> None:
    draft, watch = FakeDraft(Script(fail=fail(2, InvalidArgument("this request's prompt"))), lie=set()), Watch()
    r, records, loop = run(spec(20), FakeTarget(), draft, settings=LoopSettings(draft_retry_s=60.0), watch=watch)
    assert r.generation.generated == expected(20)
    assert {rec.target_only for rec in records[1:-1]} == {TargetOnly.DRAFT_REFUSED}
    assert draft.calls == 2 and ("draft refused the request; target-only", "InvalidArgument") in watch.events
    assert asyncio.run(loop.draft_usable()) is True  # nobody else paused


def test_a_full_draft_sheds_the_request_not_the_service() -> None:
    draft, watch = FakeDraft(Script(fail=fail(2, ResourceExhausted("no room for a session"))), lie=set()), Watch()
    r, records, loop = run(spec(20), FakeTarget(), draft, settings=LoopSettings(draft_retry_s=60.0), watch=watch)
    assert r.generation.generated == expected(20)
    assert {rec.target_only for rec in records[1:-1]} == {TargetOnly.DRAFT_REFUSED}
    assert asyncio.run(loop.draft_usable()) is True


def test_a_requests_own_deadline_never_pauses_speculation_for_others() -> None:
    """A short-deadline request whose draft call runs out of its time: it alone loses, the draft stays up."""

    async def main() -> tuple[BaseException | None, bool, list[RoundRecord], list[int]]:
        draft, target = FakeDraft(Script(hang={2})), FakeTarget()
        loop = RoundLoop(target, draft, LoopSettings(draft_timeout_s=5.0, draft_retry_s=60.0))
        short = loop.run(spec(20), max_context=MAX_CONTEXT, session_id="short", deadline=time.monotonic() + 0.2)
        error: BaseException | None = None
        try:
            _ = [rec async for rec in short.rounds()]
        except DeadlineExceeded as exc:
            error = exc
        usable = await loop.draft_usable()
        other = loop.run(spec(20), max_context=MAX_CONTEXT, session_id="other")
        records = [rec async for rec in other.rounds()]
        await loop.drain()
        return error, usable, records, other.generation.generated

    error, usable, records, generated = asyncio.run(main())
    assert isinstance(error, DeadlineExceeded)  # the short one ends by its own deadline, not retried
    assert usable  # nobody else paused
    assert generated == expected(20) and all(rec.draft_tokens for rec in records[:-1])


def test_a_draft_slower_than_its_timeout_still_pauses_speculation() -> None:
    draft = FakeDraft(Script(hang={2}))
    settings = LoopSettings(draft_timeout_s=0.05, draft_retry_s=60.0)
    _, records, loop = run(spec(20), FakeTarget(), draft, settings=settings, deadline=time.monotonic() + 30)
    assert records[1].target_only == TargetOnly.DRAFT_FAILED and asyncio.run(loop.draft_usable()) is False


def test_why_a_round_ran_target_only() -> None:
    down = FakeDraft()
    down.up = False
    budget = {TargetOnly.BUDGET}  # the last round: one token left, no room for a draft
    assert {rec.target_only for rec in run(spec(6), FakeTarget(), down)[1]} == {TargetOnly.DRAFT_UNAVAILABLE} | budget
    assert {rec.target_only for rec in run(spec(6), FakeTarget(), None)[1]} == {TargetOnly.NO_DRAFT} | budget
    off = run(spec(6, speculation="off"), FakeTarget(), FakeDraft())[1]
    assert {rec.target_only for rec in off} == {TargetOnly.SPECULATION_OFF} and not any(r.fallback for r in off)
    assert [rec.target_only for rec in run(spec(1), FakeTarget(), FakeDraft())[1]] == [TargetOnly.BUDGET]
    empty = run(spec(6, draft_length=1), FakeTarget(), FakeDraft(short=set(range(1, 20))))[1]
    assert {rec.target_only for rec in empty} == {TargetOnly.DRAFT_EMPTY} | budget
    assert all(rec.fallback for rec in empty[:-1])
    wrong = FakeDraft(step=lambda p: (target_next(p) + 1) % 61)
    r, records, _ = run(spec(200, speculation="auto", draft_length=4), FakeTarget(), wrong)
    assert r.generation.generated == expected(200)
    assert sum(rec.target_only == TargetOnly.ADAPTIVE for rec in records) > len(records) // 2  # it stopped drafting
    # but explores now and then: a greedy request by shadow guesses beside target-only rounds, a sampled one
    # by drafting rounds (test_loop_auto.py has both)
    assert wrong.calls > sum(1 for rec in records if rec.draft_tokens)


def test_lost_sessions_are_reopened_from_the_committed_tokens() -> None:
    target, draft = FakeTarget(Script(forget={3, 7})), FakeDraft(Script(forget={4}))
    r, records, _ = run(spec(40, pipeline="bonus-match"), target, draft)
    assert r.generation.generated == expected(40) and target.violations == []
    assert target.opens == 3 and draft.opens == 2
    assert not any(rec.target_only == TargetOnly.DRAFT_FAILED for rec in records)  # healed, not failed


# ---- the target failing: retries within the budget, then Unavailable; deadlines ---------------


def test_the_target_is_retried_within_its_budget() -> None:
    target, watch = FakeTarget(Script(fail=fail(2) | fail(3) | fail(9))), Watch()
    r, _, _ = run(spec(30), target, FakeDraft(), watch=watch)
    assert r.generation.generated == expected(30)
    assert watch.events.count(("target failed; retrying", "Unavailable")) == 3
    assert target.opens == 4  # each failure re-opens the session on the next try


def test_a_target_that_stays_down_fails_the_request_after_its_budget() -> None:
    target, watch = FakeTarget(Script(fail={n: Unavailable("down") for n in range(3, 10_000)})), Watch()
    with pytest.raises(Unavailable, match="could not verify within its retry budget"):
        run(spec(30), target, FakeDraft(), settings=LoopSettings(target_timeout_s=0.3), watch=watch)
    assert len(watch.records) == 2 and isinstance(watch.failed[0], Unavailable)


def test_the_deadline_bounds_a_hanging_target() -> None:
    target = FakeTarget(Script(hang={2, 3, 4, 5, 6, 7, 8}))
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="the request's deadline passed"):
        run(spec(30), target, FakeDraft(), deadline=start + 0.3)
    assert target.calls >= 2


def test_the_deadline_caps_each_draft_call() -> None:
    draft = FakeDraft(Script(hang={2}))
    r, records, _ = run(spec(20), FakeTarget(), draft, settings=LoopSettings(draft_timeout_s=0.05, draft_retry_s=0))
    assert r.generation.generated == expected(20) and records[1].target_only == TargetOnly.DRAFT_FAILED


# ---- cancellation -------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline", ["off", "bonus-match", "spec-cache"])
def test_cancelling_mid_round_frees_both_sessions(pipeline: str) -> None:
    target, draft, watch = FakeTarget(Script(slow={3: 60.0})), FakeDraft(Script(slow={4: 60.0})), Watch()

    async def main() -> RoundLoop:
        loop = RoundLoop(target, draft)
        r = loop.run(spec(40, pipeline=pipeline), max_context=MAX_CONTEXT, session_id="s1", observer=watch)

        async def consume() -> None:
            async for _ in r.rounds():
                pass

        task = asyncio.ensure_future(consume())
        while target.calls < 3:  # the third verify is in flight
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await loop.drain(timeout=5)
        return loop

    asyncio.run(main())
    assert target.closed == ["s1"] and draft.closed == ["s1"]
    assert len(watch.records) == 2 and isinstance(watch.failed[0], asyncio.CancelledError)


# ---- stop strings and the record -----------------------------------------------------------


class StopSequence:
    """A StopCheck that ends at the first occurrence of `seq` in the output, which may span rounds."""

    def __init__(self, seq: list[int]) -> None:
        self.seq, self.seen = seq, []

    def __call__(self, new: Sequence[int]) -> int | None:
        for i, t in enumerate(new):
            self.seen.append(t)
            if self.seen[-len(self.seq) :] == self.seq:
                return i + 1
        return None


def first_index(seq: list[int], part: list[int]) -> int:
    return next(i for i in range(len(seq)) if seq[i : i + len(part)] == part)


@pytest.mark.parametrize("pipeline", ["off", "post-verify"])
def test_a_stop_sequence_spanning_rounds_cuts_the_output_there(pipeline: str) -> None:
    full = expected(60)
    _, records, _ = run(spec(60, pipeline=pipeline), FakeTarget(), FakeDraft())
    ends = list(itertools.accumulate(rec.tokens for rec in records))[:-1]
    # a round's last token and the next round's first, first seen there
    at = next(e for e in ends if first_index(full, full[e - 1 : e + 1]) == e - 1)
    seq = full[at - 1 : at + 1]
    r, cut, _ = run(spec(60, pipeline=pipeline), FakeTarget(), FakeDraft(), stop=StopSequence(seq))
    assert r.finish_reason == FinishReason.STOP_STRING and r.generation.generated == full[: at + 1]
    assert cut[-1].committed == (seq[-1],)  # the stop took effect in the round after the one it began in
    check_records(r, cut)


def test_stop_tokens_and_records_are_immutable() -> None:
    stop_at = expected(30)[9]
    r, records, _ = run(spec(30, stop_token_ids=frozenset({stop_at})), FakeTarget(), FakeDraft())
    assert r.finish_reason == FinishReason.STOP_TOKEN and r.generation.generated[-1] == stop_at
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].accepted = 99  # type: ignore[misc]


def test_the_observer_sees_every_round_and_ports_get_its_carrier() -> None:
    target, watch = FakeTarget(), Watch()
    _, records, _ = run(spec(20), target, FakeDraft(), watch=watch)
    assert watch.records == records and [i for i, _ in watch.started] == list(range(len(records)))
    assert [c for _, c in watch.started] == [rec.committed_length for rec in records]
    assert {c["round"] for c in target.carriers} == {str(i) for i in range(len(records))}
    assert all(rec.wall_ms >= 0 and rec.overhead_ms == rec.wall_ms - rec.draft_ms - rec.verify_ms for rec in records)


def test_bad_requests_fail_before_any_round() -> None:
    loop = RoundLoop(FakeTarget(), FakeDraft())
    with pytest.raises(InvalidArgument, match="empty"):
        loop.run(spec(prompt_ids=[]), max_context=MAX_CONTEXT, session_id="x")
    with pytest.raises(InvalidArgument, match="context"):
        loop.run(spec(), max_context=3, session_id="x")
