"""The speculation cache over scripted ports (tests/loop_fakes.py): one branch call per round,
hits exactly for the verdicts it drafted for, and the output of no pipelining."""

from __future__ import annotations

import itertools

import pytest

from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.rounds.loop import LoopSettings, RequestRun
from specd.core.rounds.pipeline import make_pipeline
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import RoundRecord
from specd.core.rounds.steps import Branches, BranchRequest
from tests.loop_fakes import FakeDraft, FakeTarget, Script, Watch, fail, target_next
from tests.unit.core.rounds.test_loop import check_records, expected, run, spec

# ---- the speculation cache: one branch call per round, hits per outcome -------------------------


def spec_cache_run(
    n: int, branches: int, draft: FakeDraft | None = None, **settings
) -> tuple[RequestRun, list[RoundRecord], FakeTarget, FakeDraft]:
    target, draft = FakeTarget(), draft or FakeDraft()
    # Exactly `branches` per call unless a test asks for the adapted budget (test_branch_budget.py).
    loop_settings = LoopSettings(
        **{"draft_retry_s": 0.0, "branch_budget": branches, "adapt_branch_budget": False, **settings}
    )
    r, records, _ = run(spec(n, pipeline="spec-cache"), target, draft, settings=loop_settings)
    return r, records, target, draft


@pytest.mark.parametrize("branches", [1, 3, 8])
def test_spec_cache_hits_exactly_the_verdicts_it_drafted_for(branches: int) -> None:
    r, records, target, draft = spec_cache_run(160, branches)
    assert r.generation.generated == expected(160) and target.violations == [] and draft.violations == []
    check_records(r, records)
    launched = [rec for rec in records if rec.pipeline_launched]
    assert all(rec.pipeline_launched == branches for rec in launched)
    assert len(draft.branch_results) == len(launched)  # one branch call per round, all branches in it
    covered_rounds = 0
    for rec, result in zip(launched, draft.branch_results):
        assert len(result) <= branches
        covered = {(b.accepted, b.token_id) for b in result.branches}
        nxt = records[rec.index + 1] if rec.index + 1 < len(records) else None
        if nxt is None or not nxt.draft_length:
            continue
        hit = (rec.accepted, rec.token_id) in covered
        assert (nxt.pipeline_hit is not None) == hit
        covered_rounds += hit
        if hit:
            kind = "bonus" if rec.accepted == rec.draft_tokens else "recovered"
            assert nxt.pipeline_hit.outcome == f"{rec.accepted}:{kind}" and nxt.draft_ms == 0.0
            assert nxt.pipeline_hit.strategy == "spec-cache" and nxt.pipeline_hit.launched == branches
    assert covered_rounds == r.stats.pipeline_hits > 0
    outcomes = r.stats.pipeline_hits_by_outcome
    assert set(outcomes) <= {"3:bonus"} | {f"{j}:recovered" for j in range(3)}
    if branches >= 3:  # room for more than the likeliest verdict: recovered ones hit too
        assert "3:bonus" in outcomes and any(o.endswith(":recovered") for o in outcomes)
    # misses happen (a verdict outside the budget), and then the round drafts afresh
    missed = [nxt for rec, nxt in itertools.pairwise(records) if rec.pipeline_launched and nxt.pipeline_hit is None]
    assert any(nxt.draft_tokens for nxt in missed)


def test_spec_cache_costs_one_draft_call_per_round_after_a_hit() -> None:
    r, records, _, draft = spec_cache_run(120, 8)
    assert r.generation.generated == expected(120)
    proposes = sum(1 for rec in records if rec.draft_tokens and rec.pipeline_hit is None)
    assert draft.calls == proposes + len(draft.branch_results)
    assert r.stats.pipeline_hits > len(records) // 2  # most verdicts are among the 8 likeliest here


def test_spec_cache_learns_acceptance_per_position() -> None:
    """The branch call carries this request's measured acceptance per pending position."""
    seen: list[tuple[float, ...]] = []

    class Recording(FakeDraft):
        async def propose_branches(self, request: BranchRequest, *, timeout: float, carrier: Carrier) -> Branches:
            seen.append(tuple(request.acceptance))
            return await super().propose_branches(request, timeout=timeout, carrier=carrier)

    r, records, _, _ = spec_cache_run(120, 4, draft=Recording())
    assert r.generation.generated == expected(120)
    assert seen[0] == pytest.approx((0.7, 0.7, 0.7))  # the prior, before any verdict
    reached = [sum(1 for rec in records[:-1] if rec.draft_tokens and rec.accepted >= i) for i in range(3)]
    accepted = [sum(1 for rec in records[:-1] if rec.draft_tokens and rec.accepted > i) for i in range(3)]
    last = [(a + 1.4) / (n + 2.0) for a, n in zip(accepted, reached)]
    assert seen[-1] == pytest.approx(tuple(last), abs=0.05)  # the rates the verdicts before it give
    assert seen[-1] != seen[0]


@pytest.mark.parametrize(
    "script, lie",
    [
        (Script(fail=fail(2)), set()),  # call 2 is round 0's branch call: it fails
        (Script(hang={2}), set()),  # ... it never answers (the draft timeout)
        (Script(fail=fail(2, SessionOutOfSync("x")) | fail(3, SessionOutOfSync("y"))), set()),  # lost twice
        (Script(), {2, 5}),  # ... it sends a branch longer than asked
    ],
    ids=["fails", "times-out", "loses-the-session", "lies"],
)
def test_a_failing_branch_call_leaves_the_round_and_the_output_as_they_were(script: Script, lie: set[int]) -> None:
    draft, watch = FakeDraft(script, lie=lie), Watch()
    target = FakeTarget()
    settings = LoopSettings(draft_retry_s=0.0, draft_timeout_s=0.1)
    r, records, _ = run(spec(40, pipeline="spec-cache"), target, draft, settings=settings, watch=watch)
    assert r.generation.generated == expected(40) and target.violations == [] and draft.violations == []
    assert ("draft failed; target-only round", "Unavailable") in watch.events or (
        "draft failed; target-only round",
        "DeadlineExceeded",
    ) in watch.events
    assert records[0].draft_tokens and records[1].pipeline_hit is None  # round 0's branches never came
    assert r.stats.pipeline_hits > 0  # and the cache works again afterwards
    check_records(r, records)


def test_a_drafter_without_branches_at_a_port_only_misses() -> None:
    """A port answering a branch call with no branches (e.g. no room in the context): plain rounds."""

    class NoBranches(FakeDraft):
        async def propose_branches(self, request: BranchRequest, *, timeout: float, carrier: Carrier) -> Branches:
            await super().propose_branches(request, timeout=timeout, carrier=carrier)
            return Branches(())

    target = FakeTarget()
    r, records, _ = run(spec(40, pipeline="spec-cache"), target, NoBranches())
    assert r.generation.generated == expected(40) and target.violations == []
    assert r.stats.pipeline_hits == 0 and all(rec.draft_tokens for rec in records[:-1])


def test_unknown_pipeline_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="pipeline"):
        make_pipeline("nope")


def test_the_requests_last_round_does_not_wait_for_branches_nobody_will_use() -> None:
    """A verdict that ends the request (here every draft right, 8 tokens in two rounds of 3 + 1) leaves the
    next round nothing to draft: the round returns without waiting for its branch call (0.3 s a call)."""
    target = FakeTarget(draft=target_next)
    draft = FakeDraft(Script(latency_s=0.3), step=target_next)
    loop_settings = LoopSettings(draft_retry_s=0.0, branch_budget=2, adapt_branch_budget=False)
    r, records, _ = run(spec(8, pipeline="spec-cache"), target, draft, settings=loop_settings)
    assert r.generation.generated == expected(8) and target.violations == []
    assert [rec.pipeline_launched for rec in records] == [2, 2]  # both rounds made a branch call
    assert records[0].wall_ms >= 300  # the first waits for its branches (the next round's drafts)
    assert records[1].wall_ms < 300  # the last does not: less than one branch call's own sleep
