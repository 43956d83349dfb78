"""Tree rounds in the RoundLoop over scripted ports (tests/loop_fakes.py): exact, recorded, healed, refused."""

from __future__ import annotations

import pytest

from specd.core.errors import InvalidArgument
from specd.core.rounds.record import TargetOnly
from tests.loop_fakes import FakeDraft, FakeTarget, Script, Watch, chain, draft_next, fail, fake_tree
from tests.unit.core.rounds.test_loop import PROMPT, check_records, expected, run, spec


def test_tree_rounds_spell_the_target_chain_and_record_nodes_and_depth() -> None:
    target, draft = FakeTarget(), FakeDraft()
    r, records, _ = run(spec(60, draft_length=4, tree_budget=8), target, draft)
    assert r.generation.generated == expected(60)
    check_records(r, records)
    assert target.trees and all(len(t) <= 8 and t.depth <= 4 for _, t in target.trees)
    # Each tree was drafted for exactly the prefix it was verified after.
    for prefix, tree in target.trees:
        assert tree.token_ids == fake_tree(prefix, 8, tree.depth, draft_next).token_ids  # depth: cut near the end
    full = [rec for rec in records if rec.draft_length == 4]
    assert all(rec.draft_tokens == 8 for rec in full)  # draft_tokens = nodes
    assert all(0 <= rec.accepted <= 4 for rec in records)  # accepted = the path's depth
    s = r.stats
    assert s.accepted_tokens + s.rounds == 60
    assert s.accepted_per_position[0] >= s.accepted_per_position[-1]  # rounds per accepted depth
    assert len(s.accepted_per_position) <= 4


def test_a_tree_keeps_what_the_chain_of_its_depth_loses() -> None:
    """The fake draft's alternative is often the target's token: siblings lengthen the accepted path."""
    tree, _, _ = run(spec(80, draft_length=4, tree_budget=8), FakeTarget(), FakeDraft())
    chain_run, _, _ = run(spec(80, draft_length=4), FakeTarget(), FakeDraft())
    assert tree.generation.generated == chain_run.generation.generated == expected(80)
    assert tree.stats.acceptance_length > chain_run.stats.acceptance_length
    assert tree.stats.rounds < chain_run.stats.rounds


def test_tree_budget_one_is_the_chain_of_one() -> None:
    r, records, _ = run(spec(30, draft_length=1, tree_budget=1), FakeTarget(), FakeDraft())
    _, chain_records, _ = run(spec(30, draft_length=1), FakeTarget(), FakeDraft())
    assert r.generation.generated == expected(30)
    assert [rec.accepted for rec in records] == [rec.accepted for rec in chain_records]
    assert [rec.draft_token_ids for rec in records] == [rec.draft_token_ids for rec in chain_records]


def test_a_failing_or_lying_draft_turns_tree_rounds_target_only_and_stays_exact() -> None:
    watch = Watch()
    draft = FakeDraft(Script(fail=fail(2)), lie={4})
    r, records, _ = run(spec(40, draft_length=3, tree_budget=6), FakeTarget(), draft, watch=watch)
    assert r.generation.generated == expected(40)
    reasons = [rec.target_only for rec in records]
    assert reasons[1] is TargetOnly.DRAFT_FAILED  # call 2 failed
    assert TargetOnly.DRAFT_FAILED in reasons[2:]  # call 4 sent a tree too big and too deep: out of step
    assert any("draft failed" in m for m, _ in watch.events)


def test_lost_sessions_heal_in_tree_rounds() -> None:
    target = FakeTarget(Script(forget={3}))
    draft = FakeDraft(Script(forget={2}))
    r, _, _ = run(spec(30, draft_length=3, tree_budget=5), target, draft)
    assert r.generation.generated == expected(30)
    assert target.opens == 2 and draft.opens == 2


def test_no_draft_tree_rounds_are_target_only() -> None:
    r, records, _ = run(spec(12, draft_length=3, tree_budget=5), FakeTarget(), None)
    assert r.generation.generated == expected(12)
    assert records[0].target_only is TargetOnly.NO_DRAFT
    assert all(rec.target_only in (TargetOnly.NO_DRAFT, TargetOnly.BUDGET) for rec in records)


def test_the_loop_refuses_tree_requests_it_does_not_run() -> None:
    for kw, match in (
        ({"speculation": "auto"}, "speculation 'fixed'"),
        ({"pipeline": "spec-cache"}, "pipeline 'off' or 'bonus-match'"),
        ({"pipeline": "post-verify"}, "pipeline 'off' or 'bonus-match'"),
        ({"draft_length": 0}, "depth"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            run(spec(8, tree_budget=4, **kw), FakeTarget(), FakeDraft())
    # speculation off: the budget is moot, target-only rounds
    r, _, _ = run(spec(8, speculation="off", tree_budget=4), FakeTarget(), FakeDraft())
    assert r.generation.generated == expected(8)


def test_pipelined_tree_rounds_verify_the_subtree_of_a_hit_and_stay_exact() -> None:
    """pipeline bonus-match: beside each verify the draft grows the next tree after the tree's first path
    (the fake's chain) with one more level; a verdict that accepts that path with one of its guesses as
    the bonus verifies the subtree under that guess, with no draft call. Every other round drafts afresh
    for its own prefix: the draft rolled back from the path the verdict rejected."""
    target, draft = FakeTarget(), FakeDraft()
    budget = 6
    r, records, _ = run(spec(80, draft_length=3, tree_budget=budget, pipeline="bonus-match"), target, draft)
    assert r.generation.generated == expected(80)
    check_records(r, records)
    hits = [rec for rec in records if rec.pipeline_hit is not None]
    assert 0 < len(hits) < len(records) and r.stats.pipeline_hits == len(hits)
    assert all(rec.draft_ms == 0.0 for rec in hits)
    assert records[0].pipeline_launched == 1
    pre_drafts = {tuple(p): i for i, p in enumerate(draft.prefixes)}
    for rec, (prefix, tree) in zip(records, target.trees):
        assert len(prefix) == len(PROMPT) + sum(len(x.committed) for x in records[: rec.index])
        if rec.pipeline_hit is None:  # drafted for exactly its prefix
            assert tree.token_ids == fake_tree(prefix, budget, rec.draft_length, draft_next).token_ids
            continue
        # the pre-draft after the previous tree's first path: 3 budgets, one level more; the subtree
        # under the guess that was the bonus
        assert tuple(prefix[:-1]) in pre_drafts
        grown = fake_tree(prefix[:-1], 3 * budget, rec.draft_length + 1, draft_next)
        guess = next(i for i in grown.children[0] if grown.token_ids[i] == prefix[-1])
        assert tree.token_ids == grown.subtree(guess, budget, rec.draft_length).token_ids
        assert rec.pipeline_hit.kind.value == "bonus" and rec.pipeline_hit.accepted == records[rec.index - 1].accepted


def test_a_failing_pre_draft_misses_and_stays_exact() -> None:
    watch = Watch()
    draft = FakeDraft(Script(fail=fail(2)))  # call 2 is the first round's pre-draft
    spec_ = spec(40, draft_length=3, tree_budget=6, pipeline="bonus-match")
    r, records, _ = run(spec_, FakeTarget(), draft, watch=watch)
    assert r.generation.generated == expected(40)
    assert any("draft failed" in m for m, _ in watch.events)
    # no retry pause here (draft_retry_s 0): the next round drafts afresh, for its own prefix
    assert records[1].pipeline_hit is None and records[1].draft_token_ids and records[1].target_only is None


def test_fake_tree_is_the_chain_plus_siblings() -> None:
    t = fake_tree(PROMPT, 3, 3, draft_next)
    assert t.token_ids == tuple(chain(PROMPT, 3, draft_next))  # no spare node: the chain
    w = fake_tree(PROMPT, 6, 3, draft_next)
    assert len(w) == 6 and w.depth == 3 and all(len({w.token_ids[c] for c in k}) == len(k) for k in w.children)
