"""Table-driven tests of specd.core.sampling.rejection: crafted p and q, exact expectations (the sampler: test_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.sampling.rejection import SparseProposal, TargetRows, Verdict, rejection_sample
from specd.core.sampling.sampler import (
    Role,
    coins,
    draft_token,
    sample_from_probs,
    sample_sparse,
    sparse_proposal,
)
from tests.devices import DEVICE
from tests.unit.core.sampling import reference
from tests.unit.core.sampling.tables import F32, F64, I64, on_device

# --------------------------------------------------------------------------
# rejection_sample
# --------------------------------------------------------------------------


def _prop(ids, probs) -> SparseProposal:
    return SparseProposal(on_device(ids), torch.tensor(probs, dtype=F32, device=DEVICE))


def _verdict(v: Verdict) -> tuple[list[int], list[int], list[bool]]:
    return v.num_accepted.tolist(), v.next_token.tolist(), v.is_bonus.tolist()


# Each case: target_probs [1, K+1, V], drafts [1, K], proposal, num_draft, expected (n, token, bonus).
# Chosen so that the result holds for every coin (ratios 0 or >= 1, one-hot residuals).
REJECTION_CASES = {
    "all accepted -> bonus": (
        [[[0.5, 0.5, 0, 0], [0, 0.2, 0.8, 0], [0, 0, 0, 1]]],
        [[1, 2]],
        _prop([[[0, 1], [1, 2]]], [[[0.5, 0.5], [0.2, 0.8]]]),  # q == p: ratio 1
        None,
        (2, 3, True),
    ),
    "first rejected -> recovered from residual": (
        [[[0.5, 0.5, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1]]],
        [[2, 3]],  # p_0(2) = 0: always rejected
        _prop([[[1, 2], [3, 0]]], [[[0.5, 0.5], [1.0, 0.0]]]),
        None,
        (0, 0, False),  # residual max(0, p - q) = [.5, 0, 0, 0]
    ),
    "second rejected -> recovered": (
        [[[0, 1, 0, 0], [0.25, 0.25, 0.25, 0.25], [0, 0, 0, 1]]],
        [[1, 3]],
        _prop([[[1, 0], [3, 2]]], [[[1.0, 0.0], [0.75, 0.25]]]),  # p_1(3)/q = 1/3 -> see below
        None,
        None,  # coin-dependent: checked in its own test
    ),
    "greedy accept then reject": (
        [[[0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]]],  # one-hot target (temperature 0)
        [[2, 3]],
        _prop([[[2, 1], [3, 0]]], [[[0.7, 0.3], [0.9, 0.1]]]),
        None,
        (1, 0, False),  # 2 is the argmax: accepted; 3 is not: recovered = argmax 0
    ),
    "greedy all accepted": (
        [[[0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]]],
        [[2, 0]],
        _prop([[[2, 1], [3, 0]]], [[[0.7, 0.3], [0.9, 0.1]]]),
        None,
        (2, 1, True),
    ),
    "one-hot proposal (None) accepted": (
        [[[0, 1, 0, 0], [0, 0, 0, 1]]],
        [[1]],
        None,
        None,
        (1, 3, True),
    ),
    "one-hot proposal (None) rejected": (
        [[[0, 0, 1, 0], [0, 0, 0, 1]]],
        [[1]],
        None,
        None,
        (0, 2, False),
    ),
    "one-hot proposal removes the draft token": (
        [[[0.0, 0.0, 0.999, 0.001], [0, 0, 0, 1]]],
        [[2]],
        None,
        None,
        None,  # either accepted (2) or recovered 3: checked in its own test
    ),
    "num_draft padding -> bonus at num_draft": (
        [[[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]],
        [[1, 999]],  # padding slot: any value, never validated or accepted
        _prop([[[1, 0], [0, 0]]], [[[1.0, 0.0], [0.0, 0.0]]]),  # unused: id 0, prob 0
        [1],
        (1, 2, True),
    ),
    "num_draft 0 -> bonus from p_0": (
        [[[0, 0, 1, 0], [1, 0, 0, 0]]],
        [[0]],
        _prop([[[0]]], [[[1.0]]]),
        [0],
        (0, 2, True),
    ),
    "K = 0: target only": (
        [[[0, 0, 0, 1]]],
        [[]],
        None,
        None,
        (0, 3, True),
    ),
    "duplicate ids in the proposal add up": (
        [[[0, 1, 0, 0], [0, 0, 1, 0]]],
        [[1]],
        _prop([[[1, 1, 0]]], [[[0.25, 0.25, 0.5]]]),  # q(1) = 0.5 < p(1) = 1: accepted
        None,
        (1, 2, True),
    ),
}


@pytest.mark.parametrize("name", [n for n, c in REJECTION_CASES.items() if c[4] is not None])
@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.device
def test_rejection_sample_table(name, seed):
    p, drafts, prop, num_draft, (n, tok, bonus) = REJECTION_CASES[name]
    p = torch.tensor(p, dtype=F32, device=DEVICE)
    drafts = torch.tensor(drafts, dtype=I64, device=DEVICE).reshape(1, p.shape[1] - 1)
    nd = None if num_draft is None else on_device(num_draft)
    v = rejection_sample(p, drafts, prop, on_device([seed]), on_device([17]), nd)
    assert _verdict(v) == ([n], [tok], [bonus])
    assert v.num_accepted.dtype == I64 and v.next_token.dtype == I64 and v.is_bonus.dtype == torch.bool
    assert v.next_token.device.type == DEVICE.type


@pytest.mark.device
def test_rejection_sample_second_rejected_follows_the_coin():
    p, drafts, prop, _, _ = REJECTION_CASES["second rejected -> recovered"]
    p = torch.tensor(p, dtype=F32, device=DEVICE).expand(64, 3, 4)
    seeds, start = torch.arange(64, dtype=I64, device=DEVICE), torch.full((64,), 5, dtype=I64, device=DEVICE)
    prop = SparseProposal(prop.token_ids.expand(64, 2, 2), prop.probs.expand(64, 2, 2))
    v = rejection_sample(p, on_device(drafts).expand(64, 2), prop, seeds, start)
    u = coins(seeds, start[:, None] + on_device([[0, 1]]), Role.ACCEPT)  # [B, 2]
    accepted_1 = u[:, 1] < 0.25 / 0.75  # draft 0 always accepted (ratio 1/1)
    assert v.num_accepted.tolist() == (1 + accepted_1.long()).tolist()
    assert bool(v.is_bonus.eq(accepted_1).all())
    # all accepted: bonus 3 from p_2; rejected: residual max(0, p_1 - q_1) = [.25, .25, 0, 0]
    rej = ~accepted_1
    assert set(v.next_token[accepted_1].tolist()) <= {3}
    assert set(v.next_token[rej].tolist()) == {0, 1}
    u_rec = coins(seeds, (start + 1)[:, None], Role.RECOVER)[:, 0]
    assert torch.equal(v.next_token[rej], (u_rec[rej] >= 0.5).long())


def test_rejection_sample_one_hot_q_follows_the_coin():
    p, drafts, _, _, _ = REJECTION_CASES["one-hot proposal removes the draft token"]
    B = 4000
    p = torch.tensor(p, dtype=F32).expand(B, 2, 4)
    seeds, start = torch.arange(B, dtype=I64), torch.full((B,), 3, dtype=I64)
    v = rejection_sample(p, on_device(drafts).expand(B, 1), None, seeds, start)
    acc = coins(seeds, start[:, None], Role.ACCEPT)[:, 0] < float(torch.tensor(0.999, dtype=F32))
    assert torch.equal(v.num_accepted, acc.long())
    assert set(v.next_token[~acc].tolist()) == {3}  # p with the draft token removed
    assert set(v.next_token[acc].tolist()) == {3}  # bonus from p_1
    assert 0 < int((~acc).sum()) < 20


def test_rejection_sample_matches_hand_computation_with_coins():
    """A generic case against a direct transcription of the rule."""
    torch.manual_seed(7)
    B, K, V, W = 300, 3, 6, 4
    p = torch.softmax(torch.randn(B, K + 1, V), -1)  # [B, K+1, V]
    q_full = torch.softmax(torch.randn(B, K, V), -1)  # [B, K, V]
    seeds, start = torch.arange(B, dtype=I64) * 31, torch.randint(0, 100, (B,), dtype=I64)
    toks, ids, wires = [], [], []
    for i in range(K):
        t, a, w = draft_token(q_full[:, i], W, 8, seeds, start + i)
        toks, ids, wires = toks + [t], ids + [a], wires + [w]
    drafts = torch.stack(toks, 1)
    prop = SparseProposal(torch.stack(ids, 1), torch.stack(wires, 1))
    v = rejection_sample(p, drafts, prop, seeds, start)
    for b in range(B):
        n = 0
        for i in range(K):
            q = torch.zeros(V, dtype=F64).scatter_add_(0, prop.token_ids[b, i], prop.probs[b, i].double())
            q = q / q.sum()
            x = int(drafts[b, i])
            u = float(coins(seeds[b : b + 1], (start[b] + i).reshape(1, 1), Role.ACCEPT))
            if u < min(1.0, float(p[b, i, x]) / float(q[x])):
                n += 1
                continue
            res = (p[b, i].double() - q).clamp(min=0)
            u_r = coins(seeds[b : b + 1], (start[b] + i).reshape(1, 1), Role.RECOVER)[0]
            expected = (n, int(sample_from_probs(res, u_r[0])), False)
            break
        else:
            expected = (K, reference.bonus_race(p[b, K], int(seeds[b]), int(start[b] + K)), True)
        got = (int(v.num_accepted[b]), int(v.next_token[b]), bool(v.is_bonus[b]))
        assert got == expected, b
    # the mix has rejections at every position and some bonuses
    assert set(v.num_accepted.tolist()) == set(range(K + 1))


@pytest.mark.device
def test_rejection_sample_k0_is_target_only_sampling():
    torch.manual_seed(2)
    B, V = 200, 9
    p = torch.softmax(torch.randn(B, 1, V), -1).to(DEVICE)
    seeds, start = torch.arange(B, dtype=I64, device=DEVICE), torch.arange(B, dtype=I64, device=DEVICE) + 4
    v = rejection_sample(p, torch.zeros(B, 0, dtype=I64, device=DEVICE), None, seeds, start)
    want = [reference.bonus_race(p[b, 0].cpu(), int(seeds[b]), int(start[b])) for b in range(B)]
    assert v.next_token.tolist() == want
    assert bool(v.is_bonus.all()) and int(v.num_accepted.abs().sum()) == 0
    # an empty sparse proposal is the same thing
    empty = SparseProposal(
        torch.zeros(B, 0, 4, dtype=I64, device=DEVICE), torch.zeros(B, 0, 4, dtype=F32, device=DEVICE)
    )
    nothing = torch.zeros(B, 0, dtype=I64, device=DEVICE)
    assert torch.equal(rejection_sample(p, nothing, empty, seeds, start).next_token, v.next_token)


def test_rejection_sample_zero_residual_guard_samples_from_p():
    # p sums to 0.75 in float32 while q = p / 0.75: ratio 0.75 everywhere and max(0, p - q) == 0.
    p_row = [0.25, 0.25, 0.25, 0.0]
    B = 400
    p = torch.tensor([[p_row, [0, 0, 0, 1.0]]], dtype=F32).expand(B, 2, 4)
    prop = SparseProposal(
        on_device([[[0, 1, 2]]]).expand(B, 1, 3), torch.tensor([[[0.25, 0.25, 0.25]]], dtype=F32).expand(B, 1, 3)
    )
    seeds, start = torch.arange(B, dtype=I64), torch.zeros(B, dtype=I64)
    drafts = (seeds % 3)[:, None]
    v = rejection_sample(p, drafts, prop, seeds, start)
    rej = v.num_accepted == 0
    assert 50 < int(rej.sum()) < 150  # about 25%
    u_rec = coins(seeds, start[:, None], Role.RECOVER)[:, 0]
    assert torch.equal(v.next_token[rej], sample_from_probs(p[rej, 0], u_rec[rej]))
    assert set(v.next_token[rej].tolist()) <= {0, 1, 2}


def test_rejection_sample_near_equal_p_q_is_finite():
    # q is p's float32 numbers renormalised in float64: residual is rounding noise, never NaN.
    torch.manual_seed(5)
    B, V = 1000, 32
    p = torch.softmax(torch.randn(B, 2, V), -1)
    ids, wire = sparse_proposal(p[:, 0], V, 24)
    seeds, start = torch.arange(B, dtype=I64), torch.zeros(B, dtype=I64)
    u = coins(seeds, start[:, None], Role.DRAFT)[:, 0]
    drafts = sample_sparse(ids, wire, u)[:, None]
    v = rejection_sample(p, drafts, SparseProposal(ids[:, None], wire[:, None]), seeds, start)
    assert bool((v.next_token >= 0).all() and (v.next_token < V).all())
    assert float(v.num_accepted.double().mean()) > 0.99


# ---- input validation ----


def _ok_inputs():
    p = torch.full((2, 3, 4), 0.25, dtype=F32)  # [B, K+1, V]
    drafts = on_device([[0, 1], [2, 3]])
    prop = SparseProposal(on_device([[[0, 1], [1, 2]], [[2, 3], [3, 0]]]), torch.full((2, 2, 2), 0.5, dtype=F32))
    return dict(
        target_probs=p,
        draft_token_ids=drafts,
        proposal=prop,
        seeds=on_device([1, 2]),
        start_positions=on_device([0, 0]),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(draft_token_ids=on_device([[0, 4], [2, 3]])), "token id"),
        (dict(draft_token_ids=on_device([[0, -1], [2, 3]])), "token id"),
        (dict(draft_token_ids=on_device([[0, 1, 2], [2, 3, 0]])), "draft_token_ids"),
        (dict(seeds=on_device([1, 2, 3])), "seeds"),
        (dict(start_positions=on_device([[0], [0]])), "start_positions"),
        (dict(num_draft=on_device([3, 0])), "num_draft"),
        (dict(num_draft=on_device([1])), "num_draft"),
        (dict(draft_token_ids=on_device([[3, 1], [2, 3]])), "support"),  # 3 not in row 0's proposal
        (
            dict(proposal=SparseProposal(on_device([[[0, 9], [1, 2]], [[2, 3], [3, 0]]]), torch.full((2, 2, 2), 0.5))),
            "proposal token ids",
        ),
        (dict(proposal=SparseProposal(on_device([[[0, 1]], [[2, 3]]]), torch.full((2, 1, 2), 0.5))), "proposal"),
        (
            dict(proposal=SparseProposal(on_device([[[0, 1], [1, 2]], [[2, 3], [3, 0]]]), torch.full((2, 2, 2), -0.5))),
            "proposal probabilities",
        ),
        (
            dict(proposal=SparseProposal(on_device([[[0, 1], [1, 2]], [[2, 3], [3, 0]]]), torch.zeros(2, 2, 2))),
            "positive mass",
        ),
        (dict(target_probs=torch.full((2, 3), 0.25)), "target_probs"),
    ],
)
def test_rejection_sample_bad_input_raises(change, match):
    kw = _ok_inputs()
    kw.update(change)
    with pytest.raises(InvalidArgument, match=match):
        rejection_sample(**kw)


def test_rejection_sample_ok_inputs_run():
    v = rejection_sample(**_ok_inputs())
    assert v.num_accepted.shape == v.next_token.shape == v.is_bonus.shape == (2,)


# --------------------------------------------------------------------------
# the host path (issue 29): the same verdicts as the dense formulas (reference.py)
# --------------------------------------------------------------------------


def _random_round(g: torch.Generator, B: int, K: int, V: int, kind: str):
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    p[0, :, : V // 3] = 0.0  # zeros in p: residuals that vanish, drafts p gives no mass
    p = p / p.sum(-1, keepdim=True)
    x = torch.randint(0, V, (B, K), generator=g)
    prop = None
    if kind == "sparse":
        W = 6
        ids = torch.randint(0, V, (B, K, W), generator=g)
        ids[..., 0], ids[..., 1] = x, x  # the draft token in its support, twice (duplicates add up)
        prop = SparseProposal(ids, torch.randint(0, 4, (B, K, W), generator=g).float() + (torch.arange(W) == 0))
    elif kind == "q == p":  # the residual vanishes: the guard samples from p
        x = p[:, :K].argmax(-1)  # in q's support
        prop = SparseProposal(torch.arange(V).expand(B, K, V).clone(), p[:, :K].clone())
    seeds, start = torch.randint(0, 2**62, (B,), generator=g), torch.randint(0, 10**6, (B,), generator=g)
    return p, x, prop, seeds, start, torch.randint(0, K + 1, (B,), generator=g)


@pytest.mark.parametrize("dtype", [F32, torch.float16], ids=["host", "where p lives"])  # float16: the torch path
@pytest.mark.parametrize("kind", ["one-hot", "sparse", "q == p"])
def test_rejection_sample_equals_the_dense_reference(kind: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(17)
    for _ in range(60):
        B, K, V = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 6), (0, 5), (2, 50)))
        p, *rest = _random_round(g, B, K, V, kind)
        args = (p.to(dtype), *rest)
        got, want = rejection_sample(*args), reference.rejection_sample(*args)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.next_token, want.next_token)
        assert torch.equal(got.is_bonus, want.is_bonus)


def test_rejection_sample_table_cases_equal_the_dense_reference() -> None:
    for p, drafts, prop, num_draft, _ in REJECTION_CASES.values():
        p = torch.tensor(p, dtype=F32).cpu()
        x = torch.tensor(drafts, dtype=I64).reshape(1, p.shape[1] - 1)
        prop = None if prop is None else SparseProposal(prop.token_ids.cpu(), prop.probs.cpu())
        nd = torch.tensor(num_draft if num_draft is not None else [p.shape[1] - 1])
        for seed in range(20):
            args = (p, x, prop, torch.tensor([seed]), torch.tensor([17]), nd)
            got, want = rejection_sample(*args), reference.rejection_sample(*args)
            assert (got.num_accepted.tolist(), got.next_token.tolist()) == (
                want.num_accepted.tolist(),
                want.next_token.tolist(),
            )


def test_rows_are_read_only_where_the_verdict_needs_them() -> None:
    # Position i of a row while its drafts before i were accepted, and where its token is drawn.
    g = torch.Generator().manual_seed(23)
    for kind in ("one-hot", "sparse"):
        for _ in range(40):
            p, x, prop, seeds, start, nd = _random_round(g, 4, 4, 30, kind)
            read: list[tuple[int, int]] = []

            def rows(b: np.ndarray, i: np.ndarray, p: torch.Tensor = p, read: list = read) -> torch.Tensor:
                read.extend(zip(b.tolist(), i.tolist()))
                return p[torch.from_numpy(b), torch.from_numpy(i)]

            v = rejection_sample(TargetRows(tuple(p.shape), p.device, rows), x, prop, seeds, start, nd)
            dense = rejection_sample(p, x, prop, seeds, start, nd)
            assert torch.equal(v.num_accepted, dense.num_accepted) and torch.equal(v.next_token, dense.next_token)
            want = {(b, i) for b in range(4) for i in range(int(v.num_accepted[b]) + 1)}
            assert sorted(read) == sorted(want)  # each once
