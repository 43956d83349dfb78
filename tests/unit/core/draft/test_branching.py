"""The speculation cache's drafting side: the branch rule, forked KV caches, one batched pass, adoption.

Table-driven cases for the rule (specd.core.draft.branching); the runner's fork
against transformers' DynamicLayer; ModelDrafter's branch calls on the
emulator and on a tiny real model: every branch's drafts are what a fresh
propose for its prefix gives, the next call continues the branch without
recomputing it, and branch state is dropped at the next call, at close and
within the KV budget.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specd.core.draft.branching import (
    bonus_guess,
    calibrated_greedy,
    outcome_probabilities,
    select_branches,
    top_ranking,
)
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.protocol import draft_work
from specd.core.errors import Internal, InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.adaptive import PositionAcceptance
from specd.core.rounds.steps import Branches, BranchRequest, ProposeRequest
from specd.core.sampling.bonus_race import race_draw
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import UNUSABLE_LOGITS, SamplingParams, processed_probs

SIM = "sim:h100-tp2-70b,vocab_size=2048,time_scale=0"
PROMPT = [11, 22, 33, 44, 55, 66, 77]
GREEDY = SamplingParams(temperature=0.0, seed=3)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=3)


# ---- the rule ---------------------------------------------------------------------------


def rows(*dists: dict[int, float], v: int = 10) -> torch.Tensor:
    out = torch.zeros(len(dists), v)
    for i, d in enumerate(dists):
        for t, p in d.items():
            out[i, t] = p
    return out


def test_outcome_probabilities_are_the_truncated_geometric() -> None:
    assert outcome_probabilities([0.5, 0.5]) == pytest.approx([0.5, 0.25, 0.25])
    assert outcome_probabilities([1.0, 0.0]) == pytest.approx([0.0, 1.0, 0.0])
    assert outcome_probabilities([]) == [1.0]
    assert sum(outcome_probabilities([0.9, 0.3, 0.7, 0.2])) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "acceptance, budget, want",
    [
        # all accepted is likeliest (0.64): the bonus guesses 5 (x 0.6) and 6 (x 0.4) first
        ((0.8, 0.8), 2, [(2, 5), (2, 6)]),
        # then position 0 rejected (0.2): its alternative 3 (0.6 / (1 - 0.4)) = 0.2, before 1:4 (0.16 x 2/3)
        ((0.8, 0.8), 4, [(2, 5), (2, 6), (0, 3), (1, 4)]),
        # a bad draft: rejecting at 0 (0.7) dominates; the rejected token (1) is never a candidate
        ((0.3, 0.5), 3, [(0, 3), (0, 2), (2, 5)]),
        # certain acceptance: only bonus guesses, however large the budget
        ((1.0, 1.0), 5, [(2, 5), (2, 6)]),
        # the all-accepted verdict with the best bonus guess is always in, even when ranked lower
        ((0.1, 0.5), 2, [(0, 3), (2, 5)]),
    ],
)
def test_select_branches_takes_the_likeliest_verdicts(acceptance, budget, want) -> None:
    pending = [1, 7]
    probs = rows({1: 0.4, 3: 0.36, 2: 0.24}, {7: 0.5, 4: 0.3, 8: 0.2}, {5: 0.6, 6: 0.4})
    got = select_branches(top_ranking(probs, pending, budget + 1), pending, acceptance, budget)
    assert [(c.accepted, c.token_id) for c in got] == want
    assert all(a.probability >= b.probability for a, b in itertools.pairwise(got[:-1]))
    reach = outcome_probabilities(acceptance)
    expect = {(2, 5): reach[2] * 0.6, (0, 3): reach[0] * 0.36 / 0.6, (1, 4): reach[1] * 0.3 / 0.5}
    for c in got:
        if (c.accepted, c.token_id) in expect:
            assert c.probability == pytest.approx(expect[(c.accepted, c.token_id)])


def test_select_branches_breaks_ties_deeper_first_then_lower_id() -> None:
    probs = rows({1: 0.5, 4: 0.25, 3: 0.25}, {2: 0.5, 9: 0.5})  # P(0 acc) = P(1 acc) = 0.5
    got = select_branches(top_ranking(probs, [1], 5), [1], [0.5], 4)
    assert [(c.accepted, c.token_id) for c in got] == [(1, 2), (1, 9), (0, 3), (0, 4)]
    assert select_branches(top_ranking(probs, [1], 5), [1], [0.5], 0) == []


@pytest.mark.parametrize(
    "acceptance, budget, guess, want",
    [
        # a sure draft: the coupled guess (6) is the first bonus branch, at the top token's mass, then the top (5)
        ((0.9, 0.9), 2, 6, [(2, 6), (2, 5)]),
        # a guess outside the draft's top tokens is still the first bonus branch
        ((0.9, 0.9), 2, 9, [(2, 9), (2, 5)]),
        # the guess that is the top token changes nothing
        ((0.9, 0.9), 2, 5, [(2, 5), (2, 6)]),
        # a poor draft: the always-covered all-accepted verdict is the guess's
        ((0.1, 0.5), 2, 6, [(0, 3), (2, 6)]),
        # no guess (greedy): the top token's
        ((0.1, 0.5), 2, None, [(0, 3), (2, 5)]),
    ],
)
def test_the_coupled_bonus_guess_leads_the_bonus_branches(acceptance, budget, guess, want) -> None:
    pending = [1, 7]
    probs = rows({1: 0.4, 3: 0.36, 2: 0.24}, {7: 0.5, 4: 0.3, 8: 0.2}, {5: 0.6, 6: 0.4})
    got = select_branches(top_ranking(probs, pending, budget + 1), pending, acceptance, budget, guess)
    assert [(c.accepted, c.token_id) for c in got] == want
    lead = next(c for c in got if c.accepted == 2)  # the guess rated at the top token's mass, or the top itself
    assert lead.probability == pytest.approx(outcome_probabilities(acceptance)[2] * 0.6)


@pytest.mark.parametrize("measured", [0.4, 0.6, 0.85])
def test_greedy_ranking_is_temperature_scaled_to_the_measured_acceptance(measured: float) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.4, 0.0, -3.0], [3.0, 0.0, 0.0, 0.0]])  # [K+1, V], K = 2
    pending = [0, 0]  # greedy drafts: each row's argmax
    calibrated = calibrated_greedy(logits, pending, (measured, measured), width=4)
    assert calibrated is not None
    ranking, acceptance = calibrated
    assert ranking.ids[:, 0].tolist() == [0, 0, 0]  # scaling keeps each row's order
    assert torch.allclose(ranking.probs.sum(-1), torch.ones(3), atol=1e-5)  # all 4 tokens: whole rows
    own = list(ranking.own)
    assert own == pytest.approx(ranking.probs[:2, 0].tolist())
    assert sum(own) / 2 == pytest.approx(measured, abs=0.05)  # the scaled confidence reaches the measured rate
    assert sum(own) / 2 >= measured
    assert acceptance == pytest.approx(tuple(math.sqrt(measured * c) for c in own))
    assert acceptance[0] > acceptance[1]  # the more confident position is the likelier accepted
    plain = torch.softmax(logits, -1)
    assert (own[0] > float(plain[0, 0])) == (measured > float(plain[:2, 0].mean()))
    narrow = calibrated_greedy(logits, pending, (measured, measured), width=2)
    assert narrow is not None
    assert narrow[0].ids.shape == (3, 2) and torch.equal(narrow[0].probs, ranking.probs[:, :2])


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_greedy_ranking_of_a_row_that_cannot_be_sampled_is_none(bad: str) -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    if bad == "-inf":
        logits[1] = float("-inf")  # no finite logit at all
    else:
        logits[2, 321] = float(bad)  # one NaN or +inf anywhere in a row
    assert calibrated_greedy(logits, [0, 0], (0.8, 0.8), width=9) is None
    logits[1:] = torch.randn(2, 500)
    logits[1, :250] = float("-inf")  # -inf beside finite logits is a banned token, not a broken row
    assert calibrated_greedy(logits, [0, 0], (0.8, 0.8), width=9) is not None


def test_a_branch_call_whose_rows_cannot_be_sampled_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    d = sim_drafter()
    for sid in ("a", "b"):
        d.open(sid, PROMPT, GREEDY)
        d.propose(ProposeRequest(sid, len(PROMPT), len(PROMPT), [], 2))  # a's two drafts become its pending tokens
    real = d.runner.logits_batch

    def poisoned(sessions, num_last, **kw):  # a's pending rows come back with a NaN
        out = real(sessions, num_last, **kw)
        return [
            o.clone().index_fill_(-1, torch.tensor([5]), float("nan")) if n == 3 else o for o, n in zip(out, num_last)
        ]

    monkeypatch.setattr(d.runner, "logits_batch", poisoned)
    n = len(PROMPT) + 2
    work = [
        BranchRequest("a", n, n, [], 2, 2, 4, (0.8, 0.8)),  # its pending positions are read in this call
        ProposeRequest("b", len(PROMPT) + 1, len(PROMPT), [5], 2),
    ]
    failed, proposal = draft_work(d, work)
    assert isinstance(failed, Internal) and str(failed) == UNUSABLE_LOGITS
    assert isinstance(proposal, Proposal) and len(proposal) == 2


def test_position_acceptance_counts_verdicts_per_position_with_a_prior() -> None:
    a = PositionAcceptance(prior=0.5, prior_weight=2.0)
    assert a.rates(3) == (0.5, 0.5, 0.5)
    for drafted, accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        a.observe(drafted, accepted)
    # position 0 reached 4 times, accepted 3; position 1 reached 3, accepted 2; position 2 reached 1, accepted 1
    assert a.rates(4) == pytest.approx(((3 + 1) / 6, (2 + 1) / 5, (1 + 1) / 3, 0.5))


def test_a_drafter_without_a_distribution_guesses_the_bonus_only() -> None:
    got = bonus_guess(3, Proposal([9, 8, 7], compute_ms=2.0))
    assert [(b.accepted, b.token_id, b.proposal.token_ids) for b in got.branches] == [(3, 9, [8, 7])]
    assert got.branches[0].extension([1, 2, 3]) == (1, 2, 3, 9)
    assert len(bonus_guess(3, Proposal([9]))) == 0


# ---- forked KV caches --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_pair: tuple[Path, Path]) -> CausalLMRunner:
    return CausalLMRunner(load_pretrained(tiny_pair[1]).model)


def test_a_fork_shares_the_cache_and_edits_never_reach_the_other_session(llama: CausalLMRunner) -> None:
    """transformers' DynamicLayer crops by slicing and grows by concatenation: shared tensors stay intact."""
    tokens = [5, 9, 14, 3, 8, 21, 2, 7]
    s = llama.new_session(tokens)
    llama.logits(s, 1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers]
    fork = llama.fork(s)
    assert all(f.keys is m.keys for f, m in zip(fork.cache.layers, s.cache.layers))  # no copy
    llama.truncate(fork, 4)
    llama.append(fork, [30, 31])
    fork_rows = llama.logits(fork, 2)
    llama.append(s, [40])
    main_row = llama.logits(s, 1)
    for layer, (k, v) in zip(s.cache.layers, before):
        assert torch.equal(layer.keys[..., : len(tokens), :], k) and torch.equal(layer.values[..., : len(tokens), :], v)
    with torch.inference_mode():
        ref_fork = llama.model(input_ids=torch.tensor([tokens[:4] + [30, 31]]), use_cache=False).logits[0, -2:]
        ref_main = llama.model(input_ids=torch.tensor([tokens + [40]]), use_cache=False).logits[0, -1:]
    assert torch.allclose(fork_rows, ref_fork.float(), atol=5e-5)
    assert torch.allclose(main_row, ref_main.float(), atol=5e-5)


# ---- ModelDrafter: one pass for all branches ----------------------------------------------


def sim_drafter(**limits) -> ModelDrafter:
    return ModelDrafter(parse_sim_spec(SIM).runner("draft"), **limits)


def branch_call(d: ModelDrafter, sid: str, prefix: list[int], pending: int, k: int = 4, budget: int = 8) -> Branches:
    req = BranchRequest(sid, len(prefix), len(prefix), [], pending, k, budget, (0.8,) * pending)
    result = draft_work(d, [req])[0]
    assert isinstance(result, Branches), result
    return result


def fresh(make, prefix: list[int], params: SamplingParams, k: int) -> Proposal:
    ref = make()
    ref.open("ref", prefix, params)
    return ref.propose(ProposeRequest("ref", len(prefix), len(prefix), [], k))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_branch_drafts_what_a_fresh_propose_for_its_prefix_would(params: SamplingParams) -> None:
    d = sim_drafter()
    d.open("s", PROMPT, params)
    pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 4)).token_ids
    got = branch_call(d, "s", PROMPT + pending, 4)
    assert len(got) == 8
    assert len({(b.accepted, b.token_id) for b in got.branches}) == 8
    assert any(b.accepted == 4 for b in got.branches) and any(b.accepted < 4 for b in got.branches)
    for b in got.branches:
        assert b.accepted == 4 or b.token_id != pending[b.accepted]  # never the rejected token itself
        ref = fresh(sim_drafter, PROMPT + list(b.extension(pending)), params, 4)
        assert b.proposal.token_ids == ref.token_ids
        assert b.proposal.confidence == pytest.approx(ref.confidence, abs=1e-6)  # settled beside the passes too
        if ref.q_probs is not None:  # sampled: the very q the draft sampled from
            assert torch.equal(b.proposal.q_probs, ref.q_probs) and torch.equal(b.proposal.q_ids, ref.q_ids)


def test_a_sure_sampled_branch_call_covers_the_bonus_the_target_draws_when_the_draft_is_the_target() -> None:
    """With q = p (an emulated draft at agreement 1) the coupled guess is the target's bonus at every seed, and a
    sampled request's one-branch call covers it; the draft's likeliest token is the bonus at some seeds only."""
    profile = parse_sim_spec(SIM + ",agreement=1")
    target = profile.runner("target").lm
    pending, covered, top_is_bonus = [7, 9], 0, 0
    context = [*PROMPT, *pending]
    p = processed_probs(target.logits([context])[:, None], [SAMPLED])[0, 0].double().numpy()  # [V] the bonus row
    for seed in range(20):
        params = SamplingParams(temperature=SAMPLED.temperature, top_k=SAMPLED.top_k, seed=seed)
        bonus = race_draw(p, None, seed, len(context))  # the verifier's draw (rejection)
        d = ModelDrafter(profile.runner("draft"))
        d.open("s", context, params)
        req = BranchRequest("s", len(context), len(context), [], len(pending), 2, 1, (0.9, 0.9))
        result = draft_work(d, [req])[0]
        assert isinstance(result, Branches) and len(result.branches) == 1
        covered += (result.branches[0].accepted, result.branches[0].token_id) == (2, bonus)
        top_is_bonus += int(np.argmax(p)) == bonus
    assert covered == 20 and top_is_bonus < 20


def test_a_branch_pass_is_one_forward_per_step_for_every_branch_and_session() -> None:
    d = sim_drafter()
    for sid in ("a", "b"):
        d.open(sid, PROMPT, GREEDY)
    pending = d.propose(ProposeRequest("a", len(PROMPT), len(PROMPT), [], 4)).token_ids
    d.propose(ProposeRequest("b", len(PROMPT), len(PROMPT), [], 4))
    stats = d.runner.stats
    before = stats.forwards
    work = [
        BranchRequest("a", len(PROMPT) + 4, len(PROMPT) + 4, [], 4, 4, 8, (0.8,) * 4),
        ProposeRequest("b", len(PROMPT) + 1, len(PROMPT), [5], 3),  # another session's propose joins the passes
    ]
    branches, proposal = draft_work(d, work)
    assert isinstance(branches, Branches) and isinstance(proposal, Proposal) and len(proposal) == 3
    assert stats.forwards - before == 1 + 4  # the pending positions, then 4 steps: 8 branches + b per pass
    assert branches.compute_ms > 0 and branches.phases.batch_size == 2
    assert pending  # (used above)


def test_the_next_call_continues_the_branch_it_extends_without_recomputing_it() -> None:
    d = sim_drafter()
    d.open("s", PROMPT, GREEDY)
    pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 4)).token_ids
    got = branch_call(d, "s", PROMPT + pending, 4)
    b = next(b for b in got.branches if b.accepted < 4)
    committed = PROMPT + list(b.extension(pending)) + b.proposal.token_ids[:2]  # the branch, 2 of its drafts accepted
    positions = d.runner.stats.positions
    nxt = d.propose(ProposeRequest("s", len(committed) + 1, len(PROMPT), committed[len(PROMPT) :] + [7], 3))
    assert d.runner.stats.positions - positions == 1 + 1 + 1  # the new token, then two more drafts: no recompute
    assert nxt.token_ids == fresh(sim_drafter, committed + [7], GREEDY, 3).token_ids
    s = d._pool.get("s")
    assert s.branches == [] and s.kv.tokens == committed + [7] + nxt.token_ids  # the others were dropped


def test_a_call_that_continues_no_branch_rolls_the_sequence_back() -> None:
    d = sim_drafter()
    d.open("s", PROMPT, SAMPLED)
    pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 4)).token_ids
    got = branch_call(d, "s", PROMPT + pending, 4)
    covered = {(b.accepted, b.token_id) for b in got.branches}
    t = next(t for t in range(2048) if (1, t) not in covered and t != pending[1])
    committed = PROMPT + pending[:1] + [t]
    nxt = d.propose(ProposeRequest("s", len(committed), len(PROMPT), committed[len(PROMPT) :], 4))
    assert nxt.token_ids == fresh(sim_drafter, committed, SAMPLED, 4).token_ids
    assert d._pool.get("s").branches == []


def test_branch_state_is_bounded_by_the_kv_budget_and_freed_at_close() -> None:
    per_token = parse_sim_spec(SIM).runner("draft").kv_bytes_per_token
    length = len(PROMPT) + 4 + 1 + 4  # a bonus branch: prefix, its token, 4 drafts
    d = sim_drafter(max_kv_bytes=per_token * (len(PROMPT) + 4 + 3 * length))  # room for 3 branches
    d.open("s", PROMPT, GREEDY)
    pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 4)).token_ids
    assert len(branch_call(d, "s", PROMPT + pending, 4)) == 3
    assert d.kv_bytes() <= d._pool.budget.max_bytes
    d.close("s")
    assert d.active_sessions() == 0 and d.kv_bytes() == 0


def test_branch_requests_are_checked() -> None:
    d = sim_drafter()
    d.open("s", PROMPT, GREEDY)
    n = len(PROMPT)
    bad = [
        BranchRequest("s", n, n, [], 0, 4),  # nothing pending
        BranchRequest("s", n, n, [], n, 4),  # no committed token left
        BranchRequest("s", n, n, [], 2, 0),  # no tokens
        BranchRequest("s", n, n, [], 2, 4, budget=0),
        BranchRequest("s", n, n, [], 2, 4, budget=65),
        BranchRequest("s", n, n, [], 2, 4, acceptance=(0.5,)),  # one rate for two positions
        BranchRequest("s", n, n, [], 2, 4, acceptance=(0.5, math.nan)),
    ]
    for req in bad:
        assert isinstance(draft_work(d, [req])[0], InvalidArgument), req


def test_no_room_in_the_context_gives_no_branches() -> None:
    runner = parse_sim_spec(SIM + ",seed=0").runner("draft")
    runner.max_context = len(PROMPT) + 4 + 1  # the prefix fills it but for the bonus token
    d = ModelDrafter(runner)
    d.open("s", PROMPT, GREEDY)
    pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 4)).token_ids
    assert len(branch_call(d, "s", PROMPT + pending, 4)) == 0


def test_the_tiny_model_branches_agree_with_fresh_proposes(tiny_pair: tuple[Path, Path]) -> None:
    """A real CausalLMRunner: forks share cache tensors, and every branch still drafts the fresh tokens."""
    model = load_pretrained(tiny_pair[1]).model

    def make() -> ModelDrafter:
        return ModelDrafter(CausalLMRunner(model))

    d = make()
    for params in (GREEDY, SAMPLED):
        d.open("s", PROMPT, params)
        pending = d.propose(ProposeRequest("s", len(PROMPT), len(PROMPT), [], 3)).token_ids
        got = branch_call(d, "s", PROMPT + pending, 3, k=3, budget=6)
        assert len(got) == 6
        for b in got.branches:
            assert b.proposal.token_ids == fresh(make, PROMPT + list(b.extension(pending)), params, 3).token_ids
        b = got.branches[-1]
        committed = PROMPT + list(b.extension(pending))
        nxt = d.propose(ProposeRequest("s", len(committed), len(PROMPT), committed[len(PROMPT) :], 3))
        assert nxt.token_ids == b.proposal.token_ids  # the adopted branch, drafts and all


def test_an_ngram_drafter_answers_with_its_bonus_guess() -> None:
    d = NgramDrafter(100)
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]
    d.open("s", text, GREEDY)
    pending = d.propose(ProposeRequest("s", len(text), len(text), [], 2)).token_ids
    assert pending == [3, 4]
    got = draft_work(d, [BranchRequest("s", len(text) + 2, len(text) + 2, [], 2, 2)])[0]
    assert isinstance(got, Branches)
    assert [(b.accepted, b.token_id, b.proposal.token_ids) for b in got.branches] == [(2, 5, [6, 1])]
    nxt = d.propose(ProposeRequest("s", len(text) + 1, len(text), [3], 2))  # the verdict rejected 4: rolled back
    assert nxt.token_ids == [4, 5]
