"""The model drafter's sampling step: rows of a batch, a reduced head's ids, the greedy confidence."""

from __future__ import annotations

import torch

from specd.core.draft.growing_draft import DueConfidence
from specd.core.draft.model_drafter import ModelDrafter, _stacked
from specd.core.draft.protocol import draft_work
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import Branches, BranchRequest, ProposeRequest
from specd.core.sampling import compact_q
from specd.core.sampling.bonus_guess import coupled_guess
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.sparse_q import QSettings

SIM = "sim:h100-tp2-70b,vocab_size=2048,time_scale=0"
PROMPT = [5, 6, 7, 8, 9]
SESSIONS = {  # one batch: greedy and sampled rows, two q settings
    "greedy": (SamplingParams(temperature=0.0, seed=1), 0),
    "warm": (SamplingParams(temperature=0.7, seed=2), 0),
    "hot": (SamplingParams(temperature=1.3, seed=3), 0),
    "top-8": (SamplingParams(temperature=1.0, seed=4), 8),
}


def _drafter(token_map: torch.Tensor | None = None) -> ModelDrafter:
    return ModelDrafter(parse_sim_spec(SIM).runner("draft"), q=QSettings(), token_map=token_map)


def _propose(d: ModelDrafter, names: list[str]) -> dict[str, Proposal]:
    for name in names:
        params, top_k = SESSIONS[name]
        d.open(name, PROMPT, params, wire_top_k=top_k)
    results = d.propose_batch([ProposeRequest(n, len(PROMPT), len(PROMPT), [], 4) for n in names])
    out = {}
    for name, result in zip(names, results):
        assert isinstance(result, Proposal), result
        out[name] = result
    return out


def _same(a: Proposal, b: Proposal, conf: float = 0.0, weight: float = 0.0) -> None:
    """The same tokens; confidences within `conf`; q on the same ids with weights within `weight`."""
    assert a.token_ids == b.token_ids
    assert all(abs(x - y) <= conf for x, y in zip(a.confidence, b.confidence, strict=True))
    qa, qb = _q(a), _q(b)
    assert (qa is None) == (qb is None)
    for ra, rb in zip(qa or [], qb or [], strict=True):
        assert ra.keys() == rb.keys() and all(abs(ra[i] - rb[i]) <= weight for i in ra)


def _q(p: Proposal) -> list[dict[int, float]] | None:
    """Each position's q as {token id: weight} (slots of equal weight may sit in either order)."""
    if p.q_ids is None or p.q_probs is None:
        return None
    return [{int(i): float(w) for i, w in zip(ids, ws) if w > 0} for ids, ws in zip(p.q_ids, p.q_probs)]


def test_a_mixed_batch_drafts_what_each_session_drafts_alone() -> None:
    together = _propose(_drafter(), list(SESSIONS))
    for name in SESSIONS:
        _same(together[name], _propose(_drafter(), [name])[name])
    assert together["greedy"].q_ids is None
    top8 = together["top-8"].q_ids
    assert top8 is not None and top8.shape[-1] <= 8


def test_a_reduced_head_drafts_target_ids_with_the_same_numbers() -> None:
    # token_map[i] = the target id of the head's row i. The identity changes nothing; a permutation
    # changes only where each number sits, and the order of the softmax's sums: its probabilities
    # (the confidences, the weights) agree to float32 rounding.
    plain = _propose(_drafter(), list(SESSIONS))
    same = _propose(_drafter(torch.arange(2048)), list(SESSIONS))
    perm = torch.randperm(2048, generator=torch.Generator().manual_seed(0))
    mapped = _propose(_drafter(perm), list(SESSIONS))
    for name in SESSIONS:
        _same(plain[name], same[name])
        _same(plain[name], mapped[name], conf=2.0**-16, weight=1.0)  # a weight a grid step off: q(x) too


def test_the_greedy_confidence_is_the_softmax_probability_of_the_argmax() -> None:
    d = _drafter()
    got = _propose(d, ["greedy"])["greedy"]
    runner = parse_sim_spec(SIM).runner("draft")
    tokens = PROMPT + got.token_ids
    for i, conf in enumerate(got.confidence):
        logits = runner.lm.logits([tokens[: len(PROMPT) + i]])[0]  # [V] the row that drafted token i
        assert int(logits.argmax()) == got.token_ids[i]
        assert abs(conf - float(torch.softmax(logits, -1).max())) < 1e-6


def test_a_greedy_steps_confidence_is_worked_out_beside_the_next_steps_pass(monkeypatch) -> None:
    """A greedy step goes on with its argmax; its confidences wait for the next step's pass (the runner's
    `beside`), the last step's for the draft's end: each settled once, in step order."""
    d = _drafter()
    settled: list[tuple[int, int]] = []  # (forwards finished, rows due) at each settle that had rows
    settle = DueConfidence.settle

    def recording(self: DueConfidence) -> None:
        if self.rows:
            settled.append((d.runner.stats.forwards, sum(len(drafts) for _, _, drafts in self.rows)))
        settle(self)

    monkeypatch.setattr(DueConfidence, "settle", recording)
    d.open("a", PROMPT, SESSIONS["greedy"][0])
    d.open("b", [*PROMPT, 3], SESSIONS["greedy"][0])
    before = d.runner.stats.forwards
    got = d.propose_batch([ProposeRequest(s, n, n, [], 4) for s, n in (("a", 5), ("b", 6))])
    assert all(isinstance(p, Proposal) and len(p.confidence) == len(p) == 4 for p in got)
    # beside passes 2, 3 and 4 (a pass is counted when it ends), then after the last: 2 rows each
    assert settled == [(before + 1, 2), (before + 2, 2), (before + 3, 2), (before + 4, 2)]


def test_a_session_opened_without_confidence_drafts_the_same_tokens_and_leaves_the_confidence_out() -> None:
    """A fixed request's caller reads no confidence: its greedy rows skip the softmax; sampled rows and the tokens
    are as they were; a branch call's forks inherit the setting."""
    plain, spare = _drafter(), _drafter()
    for name in ("greedy", "warm"):
        params, top_k = SESSIONS[name]
        plain.open(name, PROMPT, params, wire_top_k=top_k)
        spare.open(name, PROMPT, params, wire_top_k=top_k, confidence=False)
    want = plain.propose_batch([ProposeRequest(n, len(PROMPT), len(PROMPT), [], 4) for n in ("greedy", "warm")])
    got = spare.propose_batch([ProposeRequest(n, len(PROMPT), len(PROMPT), [], 4) for n in ("greedy", "warm")])
    assert isinstance(want[0], Proposal) and isinstance(got[0], Proposal)
    assert got[0].token_ids == want[0].token_ids and got[0].confidence == () and len(want[0].confidence) == 4
    assert isinstance(want[1], Proposal) and isinstance(got[1], Proposal)
    _same(got[1], want[1])  # a sampled row's confidence is its q(token): sent as before
    n = len(PROMPT) + 4
    req = BranchRequest("greedy", n, n, [], 4, 2, 4, (0.8,) * 4)
    branches = [draft_work(d, [req])[0] for d in (plain, spare)]
    assert all(isinstance(b, Branches) for b in branches)
    for a, b in zip(branches[0].branches, branches[1].branches):  # type: ignore[union-attr]
        assert a.proposal.token_ids == b.proposal.token_ids and len(a.proposal.confidence) == 2
        assert b.proposal.confidence == ()


def test_a_steps_rows_are_stacked_as_a_view_of_the_forward_output_when_they_are_its_consecutive_rows() -> None:
    flat = torch.arange(12.0).reshape(4, 3)  # a batched forward's output, split per session as the runners do
    parts = list(flat.split([1, 1, 1, 1]))
    view = _stacked(parts[:3])
    assert torch.equal(view, flat[:3]) and view.data_ptr() == flat.data_ptr()
    for rows in ([parts[0], parts[2]], [parts[1], parts[0]], [torch.ones(1, 3), torch.zeros(1, 3)]):
        copy = _stacked(rows)  # not consecutive rows of one tensor: one copy
        assert torch.equal(copy, torch.cat(rows)) and copy.data_ptr() != flat.data_ptr()
    rows = list(flat.split([2, 1, 1]))  # a parent's [pending + 1, V] rows are never a sampled row
    assert torch.equal(_stacked(rows[1:]), flat[2:])


def test_a_bonus_guess_is_drawn_at_the_targets_coin_and_the_rest_is_a_fresh_draft_after_it() -> None:
    """Bonus-match's pre-draft (ProposeRequest.guess_bonus): its first token at the target's bonus coin from the
    q it sends (specd.core.sampling.bonus_guess), the tokens after it those a fresh draft after it would draw."""
    differs: list[int] = []  # per seed: the draft's own coin draws another first token
    for seed in range(11, 31):
        params = SamplingParams(temperature=0.7, seed=seed)
        d = _drafter()
        d.open("s", PROMPT, params)
        pre = d.propose_batch([ProposeRequest("s", len(PROMPT), len(PROMPT), [], 3, guess_bonus=True)])[0]
        assert isinstance(pre, Proposal) and pre.q_ids is not None and pre.q_probs is not None
        first = pre.token_ids[0]
        row = coupled_guess(pre.q_ids[:1], pre.q_probs[:1], torch.tensor([seed]), torch.tensor([len(PROMPT)]))
        assert first == int(row[0])
        fresh = _drafter()
        fresh.open("s", [*PROMPT, first], params)
        after = fresh.propose_batch([ProposeRequest("s", len(PROMPT) + 1, len(PROMPT) + 1, [], 2)])[0]
        assert isinstance(after, Proposal) and after.token_ids == pre.token_ids[1:]
        plain = _drafter()
        plain.open("s", PROMPT, params)
        drawn = plain.propose_batch([ProposeRequest("s", len(PROMPT), len(PROMPT), [], 1)])[0]
        assert isinstance(drawn, Proposal)
        differs.append(int(drawn.token_ids[0] != first))
    assert sum(differs) > 0  # at some seeds: the flag is read


def test_a_reduced_heads_branch_call_guesses_the_bonus_as_the_full_head_does() -> None:
    """The speculation cache's bonus guess on a reduced head, its columns taken in target-id order: with the
    identity map or a permutation of the whole vocabulary, the branches of the plain head (a guess read in
    column order would differ under the permutation)."""
    out = []
    perm = torch.randperm(2048, generator=torch.Generator().manual_seed(0))
    for token_map in (None, torch.arange(2048), perm):
        d = _drafter(token_map)
        d.open("s", PROMPT, SamplingParams(temperature=0.8, seed=5))
        result = draft_work(d, [BranchRequest("s", len(PROMPT), len(PROMPT), [], 2, 2, 3, (0.9, 0.9))])[0]
        assert not isinstance(result, Exception)
        out.append([(b.accepted, b.token_id) for b in result.branches])
    assert out[0] == out[1] == out[2] and any(j == 2 for j, _ in out[0])


def test_a_drafter_that_encodes_q_sends_each_row_as_the_wire_would_encode_it() -> None:
    """encode_q (the draft service's): every sampled row also in the wire's compact form, each step's encoded
    beside the next step's pass and the last after it; the bytes are those `to_compact` gives the finished
    proposal's q, for proposes and a branch call's branches alike, and the drafts are the same as without it.
    Greedy rows have no q to encode; without encode_q nothing is encoded."""

    def drafter(encode: bool) -> ModelDrafter:
        return ModelDrafter(parse_sim_spec(SIM).runner("draft"), q=QSettings(), encode_q=encode)

    plain, encoding = _propose(drafter(False), list(SESSIONS)), _propose(drafter(True), list(SESSIONS))
    for name in SESSIONS:
        _same(plain[name], encoding[name])
        assert plain[name].compact_q is None
        p = encoding[name]
        if p.q_ids is None or p.q_probs is None:
            assert p.compact_q is None
        else:
            assert p.compact_q == tuple(compact_q.to_compact(p.q_ids, p.q_probs)) and len(p.compact_q) == 4
    d = drafter(True)
    d.open("s", PROMPT, SamplingParams(temperature=0.8, seed=5))
    result = draft_work(d, [BranchRequest("s", len(PROMPT), len(PROMPT), [], 2, 2, 3, (0.9, 0.9))])[0]
    assert not isinstance(result, Exception) and result.branches
    for branch in result.branches:
        p = branch.proposal
        assert p.q_ids is not None and p.q_probs is not None
        assert p.compact_q == tuple(compact_q.to_compact(p.q_ids, p.q_probs))
