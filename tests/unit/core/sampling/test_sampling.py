"""Table-driven tests of specd.core.sampling.sampler: crafted logits/probs, exact expectations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specd.core.errors import InvalidArgument
from specd.core.sampling import sampler
from specd.core.sampling.rejection import SparseProposal, rejection_sample
from specd.core.sampling.sampler import (
    Role,
    SamplingParams,
    coins,
    draft_token,
    host_coins,
    processed_probs,
    sample_from_probs,
    sample_sparse,
    sparse_proposal,
    unusable_rows,
)
from tests.devices import DEVICE
from tests.unit.core.sampling.tables import F32, F64, I64, on_device, processed_row

# --------------------------------------------------------------------------
# SamplingParams validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
    ],
)
def test_bad_params_raise_invalid_argument_naming_the_field(kw, field):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**kw).validate()
    # processed_probs validates too: bad settings never reach the math.
    with pytest.raises(InvalidArgument, match=field):
        processed_probs(torch.zeros(1, 1, 4), [SamplingParams(**kw)])


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(temperature=0), dict(top_p=1.0, top_k=0, min_p=0.0), dict(top_p=1e-9, min_p=0.999, seed=2**63 - 1)],
)
def test_good_params_validate(kw):
    sp = SamplingParams(**kw)
    assert sp.validate() is sp
    assert sp.is_greedy == (sp.temperature == 0)


# --------------------------------------------------------------------------
# processed_probs
# --------------------------------------------------------------------------

P4 = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    "probs, kw, expected",
    [
        # no processing: softmax of log p is p
        (P4, dict(), P4),
        # temperature 0.5: p^2 renormalised
        (P4, dict(temperature=0.5), [v * v / sum(w * w for w in P4) for v in P4]),
        # temperature 2: sqrt(p) renormalised
        (P4, dict(temperature=2.0), [math.sqrt(v) / sum(math.sqrt(w) for w in P4) for v in P4]),
        # greedy: one-hot at argmax
        (P4, dict(temperature=0), [1, 0, 0, 0]),
        ([0.1, 0.4, 0.4, 0.1], dict(temperature=0), [0, 1, 0, 0]),  # tie -> lowest id
        # top-k
        (P4, dict(top_k=2), [0.625, 0.375, 0, 0]),
        (P4, dict(top_k=1), [1, 0, 0, 0]),
        (P4, dict(top_k=4), P4),
        (P4, dict(top_k=100), P4),  # k >= V: off
        ([0.4, 0.2, 0.2, 0.2], dict(top_k=2), [2 / 3, 1 / 3, 0, 0]),  # tie at the cut -> lower id kept
        ([0.2, 0.2, 0.2, 0.4], dict(top_k=2), [1 / 3, 0, 0, 2 / 3]),
        # top-p: smallest set with mass >= top_p, top token always kept
        (P4, dict(top_p=0.75), [0.625, 0.375, 0, 0]),
        (P4, dict(top_p=0.85), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (P4, dict(top_p=0.3), [1, 0, 0, 0]),
        (P4, dict(top_p=1e-6), [1, 0, 0, 0]),
        # top-k first, then top-p on the renormalised top-k mass
        ([0.4, 0.3, 0.2, 0.1], dict(top_k=2, top_p=0.5), [1, 0, 0, 0]),  # 4/7 >= 0.5
        ([0.4, 0.3, 0.2, 0.1], dict(top_p=0.5), [4 / 7, 3 / 7, 0, 0]),  # without top-k: 0.4 < 0.5
        # min-p: keep p >= min_p * max p
        (P4, dict(min_p=0.5), [0.625, 0.375, 0, 0]),
        (P4, dict(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        # temperature then top-k: T=0.5 gives [25, 9, 2.25, .25]/36.5 -> top-2
        (P4, dict(temperature=0.5, top_k=2), [25 / 34, 9 / 34, 0, 0]),
        # zero-probability tokens stay zero
        ([0.5, 0.0, 0.5, 0.0], dict(top_p=0.9), [0.5, 0, 0.5, 0]),
    ],
)
@pytest.mark.device
def test_processed_probs_table(probs, kw, expected):
    got = processed_row(probs, **kw)
    assert got.dtype == F32 and got.device.type == DEVICE.type
    torch.testing.assert_close(got.cpu(), torch.tensor(expected, dtype=F32), atol=2e-6, rtol=1e-5)
    assert abs(float(got.double().sum()) - 1.0) < 1e-6


def test_processed_probs_greedy_uses_float32_logits_argmax():
    logits = torch.tensor([[[1.0, 5.0, 5.0, -3.0], [0.0, 0.0, 0.0, 0.0]]], dtype=torch.bfloat16)  # [1, 2, 4]
    got = processed_probs(logits, [SamplingParams(temperature=0)])
    assert got.dtype == F32
    assert got.tolist() == [[[0, 1, 0, 0], [1, 0, 0, 0]]]


def test_processed_probs_rows_use_their_own_params_and_match_single_row():
    torch.manual_seed(3)
    logits = torch.randn(5, 3, 11) * 2  # [B, N, V]
    params = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1, seed=9),
    ]
    batched = processed_probs(logits, params)
    for b, sp in enumerate(params):
        alone = processed_probs(logits[b : b + 1], [sp])[0]
        assert torch.equal(batched[b], alone), f"row {b} differs when batched"
    torch.testing.assert_close(batched.double().sum(-1), torch.ones(5, 3, dtype=F64), atol=1e-6, rtol=0)


def test_processed_probs_accepts_half_precision_and_requires_params_per_row():
    logits = torch.randn(2, 1, 7, dtype=torch.float16)
    out = processed_probs(logits, [SamplingParams(), SamplingParams(top_k=3)])
    assert out.shape == (2, 1, 7) and out.dtype == F32
    assert int((out[1, 0] > 0).sum()) == 3
    with pytest.raises(InvalidArgument, match="one SamplingParams per row"):
        processed_probs(logits, [SamplingParams()])


# --------------------------------------------------------------------------
# sample_from_probs / sample_sparse
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, u, expected",
    [
        ([0.0, 0.5, 0.0, 0.5], 0.0, 1),  # zero-probability token 0 never chosen, even with u = 0
        ([0.0, 0.5, 0.0, 0.5], 0.4999999, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.5, 3),  # first index whose cumsum > u * total
        ([0.0, 0.5, 0.0, 0.5], 1 - 2**-53, 3),
        ([0.5, 0.5, 0.0, 0.0], 1 - 2**-53, 1),  # trailing zeros never chosen
        ([2.0, 2.0], 0.6, 1),  # unnormalised weights
        ([2.0, 6.0], 0.2, 0),
        ([1.0], 0.99, 0),
    ],
)
def test_sample_from_probs_table(probs, u, expected):
    got = sample_from_probs(torch.tensor(probs, dtype=F32), torch.tensor(u, dtype=F64))
    assert got.dtype == I64 and int(got) == expected


def test_sample_from_probs_batched_never_picks_zero_weight():
    torch.manual_seed(0)
    probs = torch.rand(4, 3, 9) * (torch.rand(4, 3, 9) > 0.5)  # [4, 3, 9] with zeros
    probs[..., 4] = 0.3  # every row has mass
    u = torch.rand(4, 3, dtype=F64)
    u[0, 0], u[1, 1] = 0.0, 1 - 2**-53
    tok = sample_from_probs(probs, u)
    assert tok.shape == (4, 3)
    assert bool((probs.gather(-1, tok[..., None]) > 0).all())


def test_sample_sparse_uses_slot_order_and_ids():
    ids = on_device([[7, 2, 5], [0, 9, 3]])  # [B, W]
    wire = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]], dtype=F32)
    assert sample_sparse(ids, wire, torch.tensor([0.6, 0.0], dtype=F64)).tolist() == [2, 9]
    assert sample_sparse(ids, wire, torch.tensor([0.8, 0.99], dtype=F64)).tolist() == [5, 9]


# --------------------------------------------------------------------------
# sparse_proposal
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "probs, k, bits, ids, wire",
    [
        # truncation to top-2 and renormalisation
        (P4, 2, 16, [0, 1], [0.625, 0.375]),
        # W = min(k, V)
        (P4, 10, 16, [0, 1, 2, 3], P4),
        # order: most likely first, ties by lower id
        ([0.1, 0.4, 0.1, 0.4], 3, 16, [1, 3, 0], [4 / 9, 4 / 9, 1 / 9]),
        # rounding to the 1/8 grid: 8t = [4, 2.4, 1.2, .4] -> [4, 2, 1, 0] -> /7
        (P4, 4, 3, [0, 1, 2, 3], [4 / 7, 2 / 7, 1 / 7, 0]),
        # half to even: t = [.375, .3125, .3125]: 4t = [1.5, 1.25, 1.25] -> [2, 1, 1]
        ([0.375, 0.3125, 0.3125], 3, 2, [0, 1, 2], [0.5, 0.25, 0.25]),
        # everything rounds to 0: the top slot keeps one grid step
        ([0.125] * 8, 8, 1, list(range(8)), [1.0] + [0.0] * 7),
        # top-1: one-hot
        (P4, 1, 16, [0], [1.0]),
    ],
)
def test_sparse_proposal_table(probs, k, bits, ids, wire):
    got_ids, got_wire = sparse_proposal(torch.tensor([probs], dtype=F32), k, bits)
    assert got_ids.dtype == I64 and got_wire.dtype == F32
    assert got_ids[0].tolist() == ids
    # exact for the hand-rounded cases; within one grid step for bits=16
    torch.testing.assert_close(
        got_wire[0], torch.tensor(wire, dtype=F32), atol=2.0**-bits if bits >= 16 else 2e-7, rtol=0
    )


def test_sparse_proposal_values_lie_on_the_grid_and_sum_to_one():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(64, 50) * 3, -1)  # [B, V]
    top_vals, top_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    t = top_vals[:, :10].double()
    t = t / t.sum(-1, keepdim=True)  # truncated, renormalised
    for bits in (3, 8, 16, 24):
        ids, wire = sparse_proposal(probs, 10, bits)
        assert ids.shape == wire.shape == (64, 10)
        assert torch.equal(ids, top_ids[:, :10])
        steps = torch.round(t * 2**bits).clamp(min=0)
        steps[:, 0] = steps[:, 0].clamp(min=1)
        # wire = steps / sum(steps): integer grid counts, renormalised, cast once to float32
        assert torch.equal(wire, (steps / steps.sum(-1, keepdim=True)).float())
        assert torch.allclose(wire.double().sum(-1), torch.ones(64, dtype=F64), atol=1e-6)
        assert torch.allclose(wire.double() * steps.sum(-1, keepdim=True), steps, atol=1e-3)
        if bits == 24:
            assert torch.allclose(wire.double(), t, atol=1e-6)


def test_sparse_proposal_zero_slot_is_never_sampled():
    ids, wire = sparse_proposal(torch.tensor([P4], dtype=F32), 4, 3)  # last slot rounds to 0
    assert float(wire[0, 3]) == 0.0
    u = torch.linspace(0, 1 - 2**-53, 4097, dtype=F64)  # [N] covers [0, 1)
    tok = sample_sparse(ids.expand(4097, 4), wire.expand(4097, 4), u)
    assert 3 not in set(tok.tolist())


@pytest.mark.parametrize(
    "k, bits, field", [(0, 16, "wire_top_k"), (-3, 16, "wire_top_k"), (4, 0, "wire_bits"), (4, 25, "wire_bits")]
)
def test_sparse_proposal_bad_args(k, bits, field):
    with pytest.raises(InvalidArgument, match=field):
        sparse_proposal(torch.tensor([P4], dtype=F32), k, bits)


def test_draft_token_samples_from_the_wire_numbers_with_draft_coins():
    probs = torch.tensor([P4] * 3, dtype=F32)  # [B, V]
    seeds, pos = on_device([1, 2, 3]), on_device([10, 11, 12])
    tok, ids, wire = draft_token(probs, 3, 3, seeds, pos)
    u = coins(seeds, pos[:, None], Role.DRAFT)[:, 0]
    assert torch.equal(tok, sample_sparse(ids, wire, u))
    ids2, wire2 = sparse_proposal(probs, 3, 3)
    assert torch.equal(ids, ids2) and torch.equal(wire, wire2)


# --------------------------------------------------------------------------
# coins
# --------------------------------------------------------------------------


def test_coins_golden_values():
    # The hash is a wire contract (draft and target must draw the same coins): pin it.
    got = coins(on_device([0, 1, 2**63 - 1]), on_device([[0, 1], [0, 1], [5, 2**40]]), Role.ACCEPT)
    again = coins(on_device([0, 1, 2**63 - 1]), on_device([[0, 1], [0, 1], [5, 2**40]]), Role.ACCEPT)
    assert got.dtype == F64 and got.shape == (3, 2)
    assert torch.equal(got, again)
    assert got.tolist() == GOLDEN_ACCEPT


GOLDEN_ACCEPT = [
    [0.39766487946437734, 0.6256442135414041],
    [0.4455448854786437, 0.2892150286943175],
    [0.09689683076902766, 0.018864214012222158],
]


def _coin_reference(seed: int, pos: int, role: int) -> float:
    """The coin hash in plain Python integers (other languages/services can port this)."""
    m = (1 << 64) - 1
    g = 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    h = mix((seed + g) & m)
    h = mix(h ^ ((pos + 2 * g) & m))
    h = mix(h ^ ((role * 3 * g) & m))
    return (h >> 11) / 2.0**53


def test_coins_match_the_reference_hash():
    seeds = [0, 1, 42, 2**40 + 3, 2**63 - 1]
    positions = [0, 1, 7, 1000, 2**31 + 5]
    for role in Role:
        got = coins(on_device(seeds), on_device([positions] * len(seeds)), role)
        for b, s in enumerate(seeds):
            for n, pos in enumerate(positions):
                assert float(got[b, n]) == _coin_reference(s, pos, int(role))


def test_coins_depend_only_on_seed_position_role():
    seeds = torch.arange(50, dtype=I64)
    pos = torch.arange(40, dtype=I64).expand(50, 40)  # [B, N]
    full = coins(seeds, pos, Role.DRAFT)  # [50, 40]
    # call order / batching irrelevant: one position at a time, rows reversed
    for n in reversed(range(40)):
        col = coins(seeds.flip(0), pos[:, n : n + 1], Role.DRAFT)[:, 0].flip(0)
        assert torch.equal(col, full[:, n])
    # different (seed, pos, role) -> different values
    all_roles = torch.stack([coins(seeds, pos, r) for r in Role])  # [4, 50, 40]
    assert all_roles.unique().numel() == all_roles.numel()
    # range and 53-bit grid
    assert float(all_roles.min()) >= 0.0 and float(all_roles.max()) < 1.0
    assert torch.equal(all_roles * 2.0**53, torch.round(all_roles * 2.0**53))


def test_coins_are_uniform_and_roles_independent():
    seeds = torch.arange(2000, dtype=I64) * 7919
    pos = torch.arange(50, dtype=I64).expand(2000, 50)
    u = {r: coins(seeds, pos, r).flatten().numpy() for r in Role}  # 100k each
    for r in Role:
        assert stats.kstest(u[r], "uniform").pvalue > 1e-3, r
    for a in Role:
        for b in Role:
            if a < b:
                assert abs(np.corrcoef(u[a], u[b])[0, 1]) < 0.02, (a, b)
    # consecutive positions of one seed are not correlated either
    grid = coins(seeds, pos, Role.ACCEPT).numpy()
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 0.02


# --------------------------------------------------------------------------
# batch invariance: a row's result never depends on its batch-mates
# --------------------------------------------------------------------------


def test_processed_probs_position_slices_match_whole():
    torch.manual_seed(4)
    logits = torch.randn(3, 5, 13) * 2
    sp = [SamplingParams(temperature=0.9, top_k=7, top_p=0.85)] * 3
    whole = processed_probs(logits, sp)
    for n in range(5):
        assert torch.equal(processed_probs(logits[:, n : n + 1], sp)[:, 0], whole[:, n])


def test_rejection_sample_rows_are_independent_of_the_batch():
    torch.manual_seed(8)
    B, K, V = 40, 2, 7
    p = torch.softmax(torch.randn(B, K + 1, V), -1)
    q = torch.softmax(torch.randn(B, K, V), -1)
    seeds, start = torch.arange(B, dtype=I64) + 100, torch.arange(B, dtype=I64)
    parts = [draft_token(q[:, i], 3, 8, seeds, start + i) for i in range(K)]
    drafts = torch.stack([t for t, _, _ in parts], 1)
    prop = SparseProposal(torch.stack([a for _, a, _ in parts], 1), torch.stack([w for _, _, w in parts], 1))
    nd = torch.randint(0, K + 1, (B,), dtype=I64)
    v = rejection_sample(p, drafts, prop, seeds, start, nd)
    perm = torch.randperm(B)
    vp = rejection_sample(
        p[perm],
        drafts[perm],
        SparseProposal(prop.token_ids[perm], prop.probs[perm]),
        seeds[perm],
        start[perm],
        nd[perm],
    )
    assert torch.equal(vp.num_accepted, v.num_accepted[perm])
    assert torch.equal(vp.next_token, v.next_token[perm])
    assert torch.equal(vp.is_bonus, v.is_bonus[perm])
    b = 5
    v1 = rejection_sample(
        p[b : b + 1],
        drafts[b : b + 1],
        SparseProposal(prop.token_ids[b : b + 1], prop.probs[b : b + 1]),
        seeds[b : b + 1],
        start[b : b + 1],
        nd[b : b + 1],
    )
    assert (int(v1.num_accepted), int(v1.next_token)) == (int(v.num_accepted[b]), int(v.next_token[b]))


# --------------------------------------------------------------------------
# host fast paths (issue 29): the same numbers as the formulas they replace
# --------------------------------------------------------------------------


def test_python_and_numpy_coins_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds = np.array([0, 3, 2**40 + 7, 2**63 - 1], dtype=np.int64)
    positions = np.array([[0, 1, 2**31 + 5, -1] * 20] * 4, dtype=np.int64)  # 80 a row: numpy above 64
    for role in Role:
        few = [host_coins(seeds[b : b + 1], positions[b : b + 1, :16], role) for b in range(4)]  # Python ints
        many = host_coins(seeds, positions, role)  # numpy
        assert np.array_equal(np.concatenate(few), many[:, :16])
        monkeypatch.setattr(sampler, "_SCALAR_COINS", 10**6)  # all in Python ints
        assert np.array_equal(host_coins(seeds, positions, role), many)
        monkeypatch.undo()


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 1.3, 37.0])
def test_the_softmax_only_path_gives_the_general_paths_bits(temperature: float) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 777, generator=g) * torch.tensor([1.0, 30.0, 1e4])[:, None, None]
    logits[0, 0, :100] = -math.inf
    params = [SamplingParams(temperature=temperature)] * 3
    fast = processed_probs(logits, params)
    # A greedy row in the batch sends every row through the general path (per-row float32 temperatures).
    general = processed_probs(torch.cat([logits, logits[:1]]), [*params, SamplingParams(temperature=0.0)])
    assert torch.equal(fast, general[:3])
    assert torch.equal(fast, torch.softmax(logits / torch.tensor(temperature, dtype=F32), -1))
    assert torch.equal(processed_probs(logits, params, checked=True), fast)  # params validated already


def test_unusable_rows_names_each_bad_row_once() -> None:
    logits = torch.zeros(5, 2, 4)
    logits[1, 1, 2] = math.nan
    logits[2, 0, 0] = math.inf
    logits[3, 1] = -math.inf
    logits[4, 0, 1] = 3e38  # finite, but x / T overflows: p is not a distribution
    p = processed_probs(logits, [SamplingParams(temperature=0.01)] * 5)
    bad = unusable_rows(logits, p)
    assert sorted(bad) == [1, 2, 3, 4]
    assert all(sampler.UNUSABLE_LOGITS in str(bad[b]) for b in (1, 2, 3))
    assert "not finite" in str(bad[4]) and sampler.UNUSABLE_LOGITS not in str(bad[4])
    # No greedy row: the logits are read only where p is bad, with the same answers.
    sampled = unusable_rows(logits, p, sampled=True)
    assert {b: str(e) for b, e in sampled.items()} == {b: str(e) for b, e in bad.items()}
    assert unusable_rows(logits[:1], p[:1], sampled=True) == {}
    # The drafter's one pass over p: each row's float64 mass and the same errors.
    total, errors = sampler.sampled_mass(logits[:, 0], p[:, 0])
    assert {b: str(e) for b, e in errors.items()} == {
        b: str(e) for b, e in unusable_rows(logits[:, :1], p[:, :1]).items()
    }
    assert np.array_equal(total[:1], p[:1, 0].double().sum(-1).numpy())
