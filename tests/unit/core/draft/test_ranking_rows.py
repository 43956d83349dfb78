"""The rows a draft keeps for its next branch call (specd.core.draft.ranking_rows): with the bonus row added
while idle, a branch call ranks without reading the pending positions again (K passes, not K + 1) and
chooses and drafts exactly what it would have after reading them."""

from __future__ import annotations

import pytest
import torch

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.protocol import draft_work
from specd.core.draft.ranking_rows import KEEP, RankingRows
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import Branches, BranchRequest, ProposeRequest
from specd.core.sampling.sampler import SamplingParams

SIM = "sim:h100-tp2-70b,vocab_size=2048,time_scale=0"
PROMPT = [11, 22, 33, 44, 55, 66, 77]
GREEDY = SamplingParams(temperature=0.0, seed=3)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=3)


def drafter() -> ModelDrafter:
    return ModelDrafter(parse_sim_spec(SIM).runner("draft"))


def branch(d: ModelDrafter, prefix: list[int], pending: int, start: int | None = None, k: int = 3) -> Branches:
    start = len(prefix) if start is None else start
    req = BranchRequest("s", len(prefix), start, prefix[start:], pending, k, 6, (0.8,) * pending)
    result = draft_work(d, [req])[0]
    assert isinstance(result, Branches), result
    return result


def proposed_after_a_branch_call(params: SamplingParams, k: int) -> tuple[ModelDrafter, ModelDrafter]:
    """Two drafters, each with session "s" that made a branch call lately (so the idle pass serves it)
    and then proposed k tokens after PROMPT + [9]: one left alone, one after its idle pass."""
    plain, kept = drafter(), drafter()
    for d in (plain, kept):
        d.open("s", PROMPT, params)
        branch(d, PROMPT + [1, 2, 3], 3, start=len(PROMPT))
        d.propose(ProposeRequest("s", len(PROMPT) + 1, len(PROMPT), [9], k))
    assert plain._pool.get("s").kv.tokens == kept._pool.get("s").kv.tokens
    forwards = kept.runner.stats.forwards
    assert kept.idle() and not kept.idle()  # one pass: the bonus row; then nothing is due
    assert kept.runner.stats.forwards - forwards == 1
    return plain, kept


def same(a: Branches, b: Branches) -> None:
    assert [(x.accepted, x.token_id, x.proposal.token_ids) for x in a.branches] == [
        (x.accepted, x.token_id, x.proposal.token_ids) for x in b.branches
    ]
    for x, y in zip(a.branches, b.branches):
        if x.proposal.q_probs is not None:
            assert torch.equal(x.proposal.q_probs, y.proposal.q_probs)


def test_rows_are_consecutive_and_dropped_after_a_changed_token() -> None:
    rows = RankingRows()
    rows.keep_all(5, torch.arange(12.0).reshape(3, 4))  # rows predicting positions 5, 6, 7
    rows.keep(8, torch.full((4,), 9.0))
    assert (rows.start, rows.end) == (5, 9)
    assert torch.equal(rows.span(6, 2), torch.tensor([[4.0, 5, 6, 7], [8, 9, 10, 11]]))
    assert rows.span(4, 2) is None and rows.span(8, 2) is None
    rows.keep(7, torch.zeros(4))  # a new row for position 7: the one after it is gone
    assert rows.end == 8 and torch.equal(rows.span(7, 1)[0], torch.zeros(4))
    rows.rewound(6)  # tokens from position 6 on changed: rows predicting 5 and 6 depend on none of them
    assert (rows.start, rows.end) == (5, 7)
    rows.keep(20, torch.ones(4))  # not consecutive: a new run
    assert (rows.start, rows.end) == (20, 21)
    rows.rewound(3)
    assert rows.span(20, 1) is None


def test_rows_are_copies_or_views_until_owned_and_at_most_keep_per_sequence() -> None:
    out = torch.zeros(2, 4)  # a forward's output: one kept row must not pin or follow it
    rows = RankingRows()
    rows.keep(0, out[0])
    out[0] += 1
    assert torch.equal(rows.span(0, 1)[0], torch.zeros(4))
    branch = RankingRows()
    branch.keep(0, out[1], view=True)  # a branch's row views the step's output until it is adopted
    assert branch.rows[0].data_ptr() == out[1].data_ptr()
    assert branch.owned() is branch
    out[1] += 1
    assert torch.equal(branch.span(0, 1)[0], torch.zeros(4))
    for position in range(1, 50):
        rows.keep(position, torch.full((4,), float(position)))
    assert len(rows.rows) == KEEP and rows.end == 50
    assert rows.span(50 - KEEP, KEEP) is not None and rows.span(49 - KEEP, 1) is None
    assert torch.equal(rows.span(49, 1)[0], torch.full((4,), 49.0))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_after_a_propose_and_the_idle_pass_a_branch_call_skips_reading_the_pending_positions(
    params: SamplingParams,
) -> None:
    plain, kept = proposed_after_a_branch_call(params, 3)
    prefix = kept._pool.get("s").kv.tokens[:]  # PROMPT, 9 and the three drafts
    before = (plain.runner.stats.forwards, kept.runner.stats.forwards)
    want, got = branch(plain, prefix, 3), branch(kept, prefix, 3)
    assert plain.runner.stats.forwards - before[0] == 1 + 3  # reads the pending positions, then 3 steps
    assert kept.runner.stats.forwards - before[1] == 3  # ranked from the kept rows
    same(want, got)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_after_a_hit_the_adopted_branch_is_ranked_from_its_own_rows(params: SamplingParams) -> None:
    plain, kept = drafter(), drafter()
    results = []
    for d in (plain, kept):
        d.open("s", PROMPT, params)
        pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 3)).token_ids
        results.append((pending, branch(d, [*PROMPT, *pending], 3)))
    (pending, first), (_, first_kept) = results
    same(first, first_kept)
    assert kept.idle()  # the bonus row of the sequence and of every branch, in one pass
    hit = next(b for b in first.branches if b.accepted < 3)  # a recovered verdict's branch hit
    prefix = [*PROMPT, *hit.extension(pending), *hit.proposal.token_ids]
    before = (plain.runner.stats.forwards, kept.runner.stats.forwards)
    want, got = branch(plain, prefix, 3, start=len(PROMPT)), branch(kept, prefix, 3, start=len(PROMPT))
    assert plain.runner.stats.forwards - before[0] == 1 + 3
    assert kept.runner.stats.forwards - before[1] == 3
    same(want, got)


def test_a_cut_proposal_is_ranked_from_the_rows_it_was_drafted_from() -> None:
    """A proposal the coordinator cut to K' tokens: the row after them is the draft's own row there."""
    plain, kept = proposed_after_a_branch_call(GREEDY, 4)
    pending = kept._pool.get("s").kv.tokens[len(PROMPT) + 1 :][:2]  # two of the four drafts sent
    prefix = [*PROMPT, 9, *pending]
    before = kept.runner.stats.forwards
    want, got = branch(plain, prefix, 2), branch(kept, prefix, 2)
    assert kept.runner.stats.forwards - before == 3
    same(want, got)


def test_a_changed_token_makes_the_call_read_the_pending_positions_again() -> None:
    plain, kept = proposed_after_a_branch_call(GREEDY, 3)
    prefix = [*PROMPT, 8, 5, 6, 7]  # another token where the kept rows' context had 9
    before = kept.runner.stats.forwards
    want, got = branch(plain, prefix, 3, start=len(PROMPT)), branch(kept, prefix, 3, start=len(PROMPT))
    assert kept.runner.stats.forwards - before == 1 + 3
    same(want, got)


def test_sessions_that_do_not_branch_get_no_idle_pass() -> None:
    d = drafter()
    d.open("s", PROMPT, GREEDY)
    d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 3))
    assert not d.idle()  # pipelining off or bonus-match: the draft stays free for their next call
    branch(d, d._pool.get("s").kv.tokens[:], 3)
    ran = []
    for extra in ([4], [5], [6]):  # after a branch call, two proposes keep the bonus row ready; then no more
        n = len(d._pool.get("s").kv.tokens)
        d.propose(ProposeRequest("s", n + 1, n, extra, 2))
        ran.append(d.idle())
    assert ran == [True, False, False]  # the second propose used up the branch call's head start
    assert d._pool.get("s").branching == 0


def test_no_idle_pass_while_more_sessions_branch_than_the_draft_serves_idle() -> None:
    """With many sessions branching the model thread is rarely idle for long: a pass started in a gap
    would hold their calls up by a whole draft step, so none runs (their calls read the rows themselves)."""
    d = drafter()
    for sid in ("a", "b", "c"):
        d.open(sid, PROMPT, GREEDY)
        d.propose(ProposeRequest(sid, len(PROMPT), len(PROMPT), [], 2))
        req = BranchRequest(sid, len(PROMPT) + 2, len(PROMPT) + 2, [], 2, 2, 4, (0.8, 0.8))
        assert isinstance(draft_work(d, [req])[0], Branches)
    assert not d.idle()  # three sessions branch
    d.close("c")
    assert d.idle()  # two: the idle pass runs


def _viewed(row: torch.Tensor) -> bool:
    """Whether the row is part of a larger tensor's storage (inference mode keeps no view's _base)."""
    return row.untyped_storage().nbytes() > row.numel() * row.element_size()


def test_a_branch_keeps_views_of_its_call_and_the_adopted_branch_owns_its_rows() -> None:
    d = drafter()
    d.open("s", PROMPT, GREEDY)
    result = branch(d, PROMPT + [1, 2, 3], 3, start=len(PROMPT))
    s = d._pool.get("s")
    assert len(s.branches) > 1 and all(_viewed(r) for b in s.branches for r in b.rows.rows)  # no copy per row
    assert d.idle()  # the bonus rows: the branches' are views too
    assert all(_viewed(r) for b in s.branches for r in b.rows.rows)
    hit = result.branches[0]
    prefix = PROMPT + [1, 2, 3][: hit.accepted] + [hit.token_id] + list(hit.proposal.token_ids)
    forwards = d.runner.stats.forwards
    branch(d, prefix, len(hit.proposal), start=len(PROMPT), k=2)  # adopts that branch, ranks from its rows
    assert d.runner.stats.forwards - forwards == 2  # no pass reading the pending positions: the kept rows served
    rows = d._pool.get("s").rows.rows
    assert len(rows) == len(hit.proposal) + 1 and not any(map(_viewed, rows))  # copies: the outputs may go
