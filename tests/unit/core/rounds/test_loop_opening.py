"""A request's opening round (LoopSettings.opening): the draft's call first, or beside the target's prefill.

Over the scripted ports of tests/loop_fakes.py, whose target is greedy: every run
must still give the target's own chain, whatever the opening.
"""

from __future__ import annotations

import pytest

from specd.core.errors import InvalidArgument
from specd.core.rounds.auto import TARGET_ONLY, Arm, AutoChooser
from specd.core.rounds.loop import LoopSettings
from specd.core.rounds.pipeline import PIPELINES
from specd.core.rounds.record import TargetOnly, TokenKind
from tests.loop_fakes import FakeDraft, FakeTarget, Script, chain, draft_next, fail, target_next
from tests.unit.core.rounds.test_loop import PROMPT, check_records, expected, run, spec

BESIDE = LoopSettings(draft_retry_s=0.0, opening="beside")


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_an_opening_beside_verifies_the_prompt_alone_while_the_draft_opens_beside_it(pipeline: str) -> None:
    """Round 0 verifies no draft token (its first token waits for no draft call); the draft's first call
    (the prompt, a guess of the first token, K more) goes out beside it, and round 1 uses it: the guess
    was right (the fake draft agrees with the target after PROMPT)."""
    assert draft_next(PROMPT) == target_next(PROMPT)
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(40, pipeline=pipeline), target, draft, settings=BESIDE)
    assert r.generation.generated == expected(40) and target.violations == [] and draft.violations == []
    check_records(r, records)
    first, second = records[0], records[1]
    assert first.draft_tokens == 0 and first.target_only is TargetOnly.OPENING and not first.fallback
    assert first.pipeline == "bonus-match" and first.pipeline_launched == 1
    assert draft.prefixes[0] == PROMPT and draft.guess_flags[0]  # the draft's first call: the guess first
    assert second.pipeline_hit is not None and second.pipeline_hit.outcome == "0:bonus"
    assert second.draft_ms == 0.0 and second.draft_tokens == 3  # K tokens after the guessed first token
    assert r.stats.target_only_rounds == 0  # an opening is no fallback


def test_a_wrong_guess_of_the_first_token_is_never_verified() -> None:
    """After a prompt where the draft's guess is not the target's token, round 1 drafts afresh for the
    prefix the opening committed; the output is the target's chain."""
    prompt = [5, 17, 3, 40]
    assert draft_next(prompt) != target_next(prompt)
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(30, prompt_ids=prompt), target, draft, settings=BESIDE)
    assert r.generation.generated == chain(prompt, 30, target_next) and target.violations == []
    assert records[0].pipeline_launched == 1 and records[1].pipeline_hit is None
    assert records[1].draft_tokens == 3 and draft.prefixes[1] == [*prompt, records[0].token_id]


def test_an_opening_pre_draft_that_lands_during_the_prefill_is_staged_at_the_target() -> None:
    target = FakeTarget(Script(latency_s=0.02))  # the prefill outlasts the draft's call (1 ms)
    r, records, _ = run(spec(30, pipeline="off"), target, FakeDraft(), settings=BESIDE)
    assert r.generation.generated == expected(30) and target.violations == []
    assert records[1].staged and records[1].pipeline_hit is not None


@pytest.mark.parametrize("pipeline", ["off", "spec-cache"])
def test_a_failing_draft_call_in_the_opening_leaves_the_output_as_it_was(pipeline: str) -> None:
    """The opening's draft call fails: the opening's verdict stands, and the next round has no pre-draft
    (it drafts afresh: the loop's draft_retry_s is 0 here) and drafts for the prefix the opening committed."""
    target, draft = FakeTarget(), FakeDraft(Script(fail=fail(1)))
    r, records, _ = run(spec(30, pipeline=pipeline), target, draft, settings=BESIDE)
    assert r.generation.generated == expected(30) and target.violations == []
    check_records(r, records)
    assert records[0].target_only is TargetOnly.OPENING and records[1].pipeline_hit is None
    assert records[1].draft_tokens > 0 and draft.prefixes[0] == [*PROMPT, records[0].token_id]


def test_a_post_verify_round_after_the_opening_defers_its_bonus_staged_or_not() -> None:
    """The round after the opening must not depend on whether the opening's pre-draft landed during the
    prefill (at T > 0 deferring changes which coin decides a position): staged, it defers its bonus as
    it would verified after the opening's verdict."""
    outputs = []
    for latency_s in (0.02, 0.0):  # the prefill outlasts the draft's call (staged), or not
        target = FakeTarget(Script(latency_s=latency_s))
        r, records, _ = run(spec(30, pipeline="post-verify"), target, FakeDraft(), settings=BESIDE)
        assert r.generation.generated == expected(30) and target.violations == []
        assert records[1].pipeline_hit is not None
        assert records[1].token_kind is TokenKind.DEFERRED  # all accepted: post-verify deferred its bonus
        outputs.append([(x.draft_token_ids, x.accepted, x.token_kind) for x in records])
        assert records[1].staged == bool(latency_s)
    assert outputs[0] == outputs[1]


def test_draft_first_is_the_default_and_beside_needs_room_for_a_second_round() -> None:
    _, records, _ = run(spec(20), FakeTarget(), FakeDraft())
    assert records[0].draft_tokens == 3 and records[0].target_only is None  # draft-first
    draft = FakeDraft()
    r, records, _ = run(spec(1), FakeTarget(), draft, settings=BESIDE)  # one token: no round after it
    assert r.generation.generated == expected(1) and draft.calls == 0
    assert records[0].target_only is TargetOnly.BUDGET


def test_auto_learns_nothing_from_an_opening_beside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opening's verify is the target's prefill and its pre-draft the draft's: no arm's costs."""
    seen: list[int] = []
    observe = AutoChooser.observe_round

    def spy(self: AutoChooser, *args, **kwargs) -> None:
        seen.append(len(seen))
        observe(self, *args, **kwargs)

    monkeypatch.setattr(AutoChooser, "observe_round", spy)
    pre_drafts: list[str] = []
    observe_pre = AutoChooser.observe_pre_draft
    monkeypatch.setattr(
        AutoChooser,
        "observe_pre_draft",
        lambda self, cls, pipeline, k, ms: (pre_drafts.append(pipeline), observe_pre(self, cls, pipeline, k, ms)),
    )
    r, records, _ = run(spec(40, speculation="auto", pipeline="off"), FakeTarget(), FakeDraft(), settings=BESIDE)
    assert r.generation.generated == expected(40)
    assert records[0].target_only is TargetOnly.OPENING and records[0].pipeline_launched == 1
    assert len(seen) == len(records) - 1 and pre_drafts == []  # the request pipelines nothing itself


def test_an_unknown_opening_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="opening must be one of draft-first, beside"):
        LoopSettings(opening="later")


def test_the_round_after_an_opening_beside_runs_the_arm_auto_chose_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto's choice for the opening (a probe, say) gets its verdict in the next round, which the opening
    verified none of its drafts for: a probe followed by a fresh choice (still without a verdict: held
    target-only) learnt nothing and probed again in the next request's opening."""
    arms = iter([Arm("off", 2)])
    monkeypatch.setattr(AutoChooser, "choose", lambda self, cls: next(arms, TARGET_ONLY))
    r, records, _ = run(spec(20, speculation="auto", pipeline="off"), FakeTarget(), FakeDraft(), settings=BESIDE)
    assert r.generation.generated == expected(20)
    assert records[0].target_only is TargetOnly.OPENING
    assert records[1].draft_length == 2 and records[1].draft_tokens == 2  # the opening's arm
    assert all(rec.target_only is TargetOnly.ADAPTIVE for rec in records[2:])
