"""Statistical exactness of speculative sampling (ARCHITECTURE.md §3).

Both q builders run: the fixed top-k of specd.core.sampling.sampler and the model
drafter's q by mass (specd.core.sampling.sparse_q, the end of this file). Many seeded rows (one seed per row, B = 20,000) go through the real drafter
step and rejection sampler in one batch; the emitted tokens must follow the
target's processed distribution (chi-square, p > 0.001). Each test also runs
deliberately broken variants, which must be rejected (p < 1e-6): the test
has the power to see the bugs it is about. All randomness is seeded, so the
outcomes are deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from specd.core.errors import InvalidArgument
from specd.core.sampling import sparse_q
from specd.core.sampling.rejection import SparseProposal, rejection_sample
from specd.core.sampling.sampler import (
    Role,
    SamplingParams,
    coins,
    draft_token,
    processed_probs,
    sample_from_probs,
    sample_sparse,
    sparse_proposal,
)
from specd.core.sampling.sparse_q import QSettings
from tests.devices import DEVICE

pytestmark = pytest.mark.slow

F64 = torch.float64
I64 = torch.int64
B = 20_000
PASS_P = 1e-3  # a correct sampler must not be rejected at this level
FAIL_P = 1e-6  # a broken one must be rejected at this level


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of categorical samples to probs, pooling bins with expected < 5.

    tokens: [n] int64 sample ids in [0, len(probs)); probs: [M] expected probabilities.
    A sample in a zero-probability bin is an outright failure (p-value 0).
    """
    probs = probs.to("cpu", F64).numpy()
    probs = probs / probs.sum()
    n = tokens.numel()
    counts = np.bincount(tokens.cpu().numpy(), minlength=probs.size).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if obs.size < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def _rows(p: torch.Tensor, n: int = B) -> torch.Tensor:
    return p.expand(n, *p.shape)


# --------------------------------------------------------------------------
# Single position: the first emitted token (accepted draft or recovered)
# --------------------------------------------------------------------------

V1 = 32
_g = torch.Generator().manual_seed(1234)
TARGET_LOGITS = torch.randn(V1, generator=_g) * 2.0  # [V]
DRAFT_LOGITS = TARGET_LOGITS + torch.randn(V1, generator=_g) * 1.5  # [V] a decent but imperfect draft

Drafter = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor], tuple]


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] processed probabilities."""
    return processed_probs(logits[None, None], [params])[0, 0]


def first_token(
    params: SamplingParams,
    wire_top_k: int,
    wire_bits: int = 16,
    drafter: Drafter = draft_token,
    verifier: Callable = rejection_sample,
    one_hot: bool = False,
    seed0: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run B rows (seed per row) of one K=1 round; return (emitted first tokens [B], target p [V]).

    On SPECD_TEST_DEVICE: the tests marked `device` are the chi-square cells scripts/gpu_check.sh runs on CUDA."""
    p = _processed(TARGET_LOGITS.to(DEVICE), params)  # [V]
    q = _processed(DRAFT_LOGITS.to(DEVICE), params)  # [V] the draft applies the request's settings too
    seeds = torch.arange(B, dtype=I64, device=DEVICE) + seed0
    start = torch.full((B,), 11, dtype=I64, device=DEVICE)
    if one_hot:
        # n-gram-like draft, no q sent: half the rows propose the draft's favourite, half a spread of tokens
        tok = torch.where(seeds % 2 == 0, q.argmax(), (seeds * 7 + 3) % V1)
        proposal = None
    else:
        tok, ids, wire = drafter(_rows(q), wire_top_k, wire_bits, seeds, start)
        proposal = SparseProposal(ids[:, None], wire[:, None])
    target_probs = _rows(p[None].expand(2, V1))  # [B, K+1=2, V]
    v = verifier(target_probs, tok[:, None], proposal, seeds, start)
    emitted = torch.where(v.num_accepted == 1, tok, v.next_token)
    return emitted, p


GRID = list(
    itertools.product(
        [0.7, 1.0, 1.5],  # temperature
        [0, 20],  # top_k (V = 32, so 20 truncates)
        [1.0, 0.9],  # top_p
        [1, 4, 32],  # wire top-k
    )
)


@pytest.mark.device
@pytest.mark.parametrize("temperature, top_k, top_p, wire_top_k", GRID)
def test_first_token_matches_target(temperature, top_k, top_p, wire_top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    emitted, p = first_token(params, wire_top_k)
    assert chi2_pvalue(emitted, p) > PASS_P


@pytest.mark.device
@pytest.mark.parametrize(
    "params",
    [SamplingParams(min_p=0.05), SamplingParams(temperature=1.2, top_k=10, top_p=0.8, min_p=0.02)],
)
@pytest.mark.parametrize("wire_bits", [3, 8])
def test_first_token_matches_target_min_p_and_coarse_wire(params, wire_bits):
    emitted, p = first_token(params, 8, wire_bits=wire_bits)
    assert chi2_pvalue(emitted, p) > PASS_P


@pytest.mark.device
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
def test_first_token_one_hot_draft_matches_target(params):
    emitted, p = first_token(params, 1, one_hot=True)
    assert chi2_pvalue(emitted, p) > PASS_P


# ---- broken variants: the same test must catch them ----


def draft_unrounded(probs, wire_top_k, wire_bits, seeds, positions):
    """BUG: samples from the truncated q before rounding, but sends the rounded q."""
    ids, wire = sparse_proposal(probs, wire_top_k, wire_bits)
    vals = probs.gather(-1, ids).double()
    u = coins(seeds, positions[:, None], Role.DRAFT)[:, 0]
    return sample_sparse(ids, vals.float(), u), ids, wire


def draft_shares_accept_coin(probs, wire_top_k, wire_bits, seeds, positions):
    """BUG: the draft's coin is the target's accept coin (not independent)."""
    ids, wire = sparse_proposal(probs, wire_top_k, wire_bits)
    u = coins(seeds, positions[:, None], Role.ACCEPT)[:, 0]
    return sample_sparse(ids, wire, u), ids, wire


def verify_recover_from_p(target_probs, draft_token_ids, proposal, seeds, start_positions, num_draft=None):
    """BUG: the recovered token ignores q (drawn from p instead of the residual)."""
    v = rejection_sample(target_probs, draft_token_ids, proposal, seeds, start_positions, num_draft)
    j = v.num_accepted
    p_j = target_probs[torch.arange(len(j)), j]  # [B, V]
    u = coins(seeds, (start_positions + j)[:, None], Role.RECOVER)[:, 0]
    wrong = sample_from_probs(p_j, u)
    return type(v)(v.num_accepted, torch.where(v.is_bonus, v.next_token, wrong), v.is_bonus)


@pytest.mark.parametrize(
    "name, kw",
    [
        # wire top-3 on a 1/8 grid: every slot stays > 0, so the bug is silent but biased
        ("draft samples unrounded q, sends rounded q", dict(drafter=draft_unrounded, wire_top_k=3, wire_bits=3)),
        ("draft reuses the accept coin", dict(drafter=draft_shares_accept_coin, wire_top_k=32)),
        ("residual ignores q", dict(verifier=verify_recover_from_p, wire_top_k=32)),
        ("residual ignores q, one-hot draft", dict(verifier=verify_recover_from_p, wire_top_k=1, one_hot=True)),
    ],
)
def test_first_token_broken_variants_are_caught(name, kw):
    emitted, p = first_token(SamplingParams(temperature=1.5), **kw)
    pv = chi2_pvalue(emitted, p)
    assert pv < FAIL_P, f"{name}: p-value {pv:.3g} (the test cannot see this bug)"


def test_draft_sampling_a_slot_it_sent_as_zero_is_refused():
    """The loud form of the unrounded-q bug: a sampled token whose wire value rounded to 0."""
    with pytest.raises(InvalidArgument, match="support"):
        first_token(SamplingParams(), 8, wire_bits=3, drafter=draft_unrounded)


# --------------------------------------------------------------------------
# Joint distribution of the first 3 tokens, through a small speculative loop
# --------------------------------------------------------------------------

V3 = 5
MAXLEN = 8  # longest prefix a model is asked about (2 committed + 3 drafted, with room)
_g3 = torch.Generator().manual_seed(99)
T_TABLE = torch.randn((V3 + 1) ** 6, V3, generator=_g3) * 1.5  # [states, V] target "model"
D_TABLE = T_TABLE + torch.randn((V3 + 1) ** 6, V3, generator=_g3) * 1.0  # draft: noisy copy
_POW = (V3 + 1) ** torch.arange(MAXLEN, dtype=I64)  # [MAXLEN]


def model_logits(table: torch.Tensor, seq: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """A fixed function from prefix to logits: table lookup by the prefix's code.

    table: [S, V]; seq: [B, MAXLEN] int64; length: [B] int64 -> logits [B, V]
    code = sum_j (tok_j + 1) (V+1)^j over j < length: distinct for distinct prefixes.
    """
    live = torch.arange(MAXLEN)[None, :] < length[:, None]  # [B, MAXLEN]
    code = ((seq + 1) * _POW * live).sum(-1)  # [B]
    return table[code]


def _probs(table: torch.Tensor, seq: torch.Tensor, length: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = model_logits(table, seq, length)  # [B, V]
    # rows share settings (only seeds differ): one vectorised call as [1, B, V]
    return processed_probs(logits[None], [params])[0]  # [B, V]


def generate3(
    K: int,
    params: SamplingParams,
    seeds: torch.Tensor,
    wire_top_k: int = V3,
    wire_bits: int = 16,
    draft_params: SamplingParams | None = None,
    drafter: Drafter = draft_token,
    verifier: Callable = rejection_sample,
) -> torch.Tensor:
    """Speculative decoding of 3 tokens from an empty prompt; rows in lockstep. Returns [B, 3]."""
    draft_params = draft_params or params
    n = seeds.numel()
    seq = torch.zeros(n, MAXLEN, dtype=I64)  # committed tokens
    length = torch.zeros(n, dtype=I64)  # committed length == position of the next token
    rows = torch.arange(n)
    while bool((length < 3).any()):
        active = length < 3
        # finished rows ride along at position 0 (results discarded) so prefixes stay short
        length = torch.where(active, length, 0)
        cur = seq.clone()
        ids, wires = [], []
        for i in range(K):  # draft K tokens autoregressively
            q = _probs(D_TABLE, cur, length + i, draft_params)
            tok, a, w = drafter(q, wire_top_k, wire_bits, seeds, length + i)
            cur[rows, length + i] = tok
            ids.append(a)
            wires.append(w)
        p = torch.stack([_probs(T_TABLE, cur, length + i, params) for i in range(K + 1)], 1)  # [B, K+1, V]
        drafts = torch.stack([cur[rows, length + i] for i in range(K)], 1) if K else torch.zeros(n, 0, dtype=I64)
        proposal = SparseProposal(_stack_padded(ids), _stack_padded(wires)) if K else None
        v = verifier(p, drafts, proposal, seeds, length)
        # commit accepted drafts + the recovered/bonus token, for rows not yet done
        new = torch.cat([drafts, torch.zeros(n, 1, dtype=I64)], 1)  # [B, K+1]
        new[rows, v.num_accepted] = v.next_token
        for i in range(K + 1):
            write = active & (i <= v.num_accepted) & (length + i < MAXLEN)
            seq[rows[write], (length + i)[write]] = new[write, i]
        length = torch.where(active, length + v.num_accepted + 1, 3)
    return seq[:, :3]


def _stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """K x [B, W_i] -> [B, K, max W_i], zero-padded (q by mass: positions have their own widths)."""
    width = max(r.shape[1] for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows], 1)


def exact_joint(params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) under target-only sampling: product of processed conditionals. [V^3] float64."""
    triples = torch.tensor(list(itertools.product(range(V3), repeat=3)), dtype=I64)  # [V^3, 3]
    seq = torch.zeros(len(triples), MAXLEN, dtype=I64)
    seq[:, :3] = triples
    joint = torch.ones(len(triples), dtype=F64)
    for j in range(3):
        p = _probs(T_TABLE, seq, torch.full((len(triples),), j, dtype=I64), params).double()
        joint *= p.gather(-1, triples[:, j : j + 1]).squeeze(-1)
    return joint


def _code3(tokens: torch.Tensor) -> torch.Tensor:
    return tokens[:, 0] * V3 * V3 + tokens[:, 1] * V3 + tokens[:, 2]


JOINT_PARAMS = {
    "plain": (SamplingParams(), V3, 16),
    "filtered, truncated coarse wire": (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), 3, 4),
}


@pytest.mark.parametrize("setting", list(JOINT_PARAMS))
def test_joint_first_three_tokens_match_target_for_every_k(setting):
    params, wire_top_k, wire_bits = JOINT_PARAMS[setting]
    joint = exact_joint(params)
    seeds = torch.arange(B, dtype=I64) * 3 + 1
    hists = []
    for K in (0, 1, 2, 3):
        out = generate3(K, params, seeds, wire_top_k, wire_bits)
        code = _code3(out)
        pv = chi2_pvalue(code, joint)
        assert pv > PASS_P, f"K={K}: p-value {pv:.3g}"
        hists.append(np.bincount(code.numpy(), minlength=V3**3))
    # different K: the same distribution (contingency test over K on the well-populated cells)
    table = np.array(hists)
    cols = table.min(0) >= 5
    pooled = table[:, ~cols].sum(1, keepdims=True)
    table = np.column_stack([table[:, cols]] + ([pooled] if pooled.sum() > 0 else []))
    assert stats.chi2_contingency(table).pvalue > PASS_P


@pytest.mark.parametrize(
    "name, kw",
    [
        ("residual ignores q", dict(verifier=verify_recover_from_p)),
        ("draft reuses the accept coin", dict(drafter=draft_shares_accept_coin)),
    ],
)
def test_joint_broken_variants_are_caught(name, kw):
    """The loop's power check: the same comparison rejects known bugs."""
    params = SamplingParams()
    out = generate3(2, params, torch.arange(B, dtype=I64), **kw)
    pv = chi2_pvalue(_code3(out), exact_joint(params))
    assert pv < FAIL_P, f"{name}: p-value {pv:.3g}"


def _argmax_chain() -> list[int]:
    seq = torch.zeros(1, MAXLEN, dtype=I64)
    for j in range(3):
        seq[0, j] = int(model_logits(T_TABLE, seq, torch.tensor([j])).argmax())
    return seq[0, :3].tolist()


@pytest.mark.parametrize("draft_temperature", [0.0, 1.0])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_greedy_output_is_the_argmax_chain(K, draft_temperature):
    seeds = torch.arange(2000, dtype=I64)
    out = generate3(K, SamplingParams(temperature=0), seeds, draft_params=SamplingParams(temperature=draft_temperature))
    assert (out == torch.tensor(_argmax_chain())).all(), "greedy speculative output differs from target argmax"


def test_same_seed_same_output_and_batch_order_irrelevant():
    params = SamplingParams(temperature=0.9, top_p=0.95)
    seeds = torch.arange(3000, dtype=I64) * 101
    a = generate3(2, params, seeds)
    b = generate3(2, params, seeds)
    assert torch.equal(a, b)
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(0))
    c = generate3(2, params, seeds[perm])
    assert torch.equal(c, a[perm])
    d = generate3(2, params, seeds + 1)
    assert not torch.equal(d, a)


# --------------------------------------------------------------------------
# The sparse q by mass (specd.core.sampling.sparse_q): the same tests and power checks
# --------------------------------------------------------------------------


def draft_by_mass(epsilon: float, max_tokens: int) -> Drafter:
    """The model drafter's step: q by mass, capped, integer weights (wire_top_k unused)."""

    def drafter(probs, _wire_top_k, wire_bits, seeds, positions):
        return sparse_q.draft(probs, QSettings(epsilon, max_tokens, wire_bits), seeds, positions)

    return drafter


# (epsilon, budget): heavy truncation by mass, the default epsilon, a budget that binds, every token
MASS_SETTINGS = [(0.3, 32), (1e-3, 32), (1e-3, 4), (0.0, 32)]
# Each of the 8 (temperature, top_k, top_p) settings once, paired up so that every q setting meets a
# setting and its complement (both levels of each of the three): 8 cells, not the full 32 (1.5-2 s
# each on 20,000 rows; the suite has to fit CI's ten minutes). Every pair of levels still meets.
_SAMPLING = list(itertools.product([0.7, 1.5], [0, 20], [1.0, 0.9]))
MASS_GRID = [
    (*setting, mass)
    for n, mass in enumerate(MASS_SETTINGS)
    for setting in (_SAMPLING[n], _SAMPLING[7 - n])  # index 7 - n: every level flipped
]


@pytest.mark.parametrize("temperature, top_k, top_p, mass", MASS_GRID)
def test_first_token_matches_target_with_q_by_mass(temperature, top_k, top_p, mass):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    emitted, p = first_token(params, 0, wire_bits=20, drafter=draft_by_mass(*mass))
    assert chi2_pvalue(emitted, p) > PASS_P


@pytest.mark.parametrize("params", [SamplingParams(min_p=0.05), SamplingParams(temperature=1.2, top_p=0.8)])
@pytest.mark.parametrize("wire_bits", [3, 8])
def test_first_token_matches_target_with_q_by_mass_on_a_coarse_grid(params, wire_bits):
    emitted, p = first_token(params, 0, wire_bits=wire_bits, drafter=draft_by_mass(0.05, 32))
    assert chi2_pvalue(emitted, p) > PASS_P


def draft_by_mass_unrounded(probs, _wire_top_k, wire_bits, seeds, positions):
    """BUG: samples from the kept tokens' unrounded probabilities, sends the rounded weights."""
    ids, weights = sparse_q.build(probs, QSettings(0.3, 32, wire_bits))
    vals = probs.gather(-1, ids) * (weights > 0)
    u = coins(seeds, positions[:, None], Role.DRAFT)[:, 0]
    return sample_sparse(ids, vals.float(), u), ids, weights


def draft_by_mass_sends_one_more(probs, _wire_top_k, wire_bits, seeds, positions):
    """BUG (an off-by-one at the cut): samples from the kept tokens, sends the next one too."""
    settings = QSettings(0.3, 32, wire_bits)
    tok, ids, weights = sparse_q.draft(probs, settings, seeds, positions)
    wider_ids, _ = sparse_q.build(probs, QSettings(0.0, ids.shape[1] + 1, wire_bits))
    extra = wider_ids[:, -1:]  # [B, 1] the most likely token left out
    w_extra = probs.gather(-1, extra).double() / probs.gather(-1, ids).mul(weights > 0).sum(-1, keepdim=True)
    return tok, torch.cat([ids, extra], 1), torch.cat([weights, torch.round(w_extra * 2**wire_bits).float()], 1)


def draft_by_mass_shares_accept_coin(probs, _wire_top_k, wire_bits, seeds, positions):
    """BUG: the draft's coin is the target's accept coin."""
    ids, weights = sparse_q.build(probs, QSettings(1e-3, 32, wire_bits))
    u = coins(seeds, positions[:, None], Role.ACCEPT)[:, 0]
    return sample_sparse(ids, weights, u), ids, weights


@pytest.mark.parametrize(
    "name, kw",
    [
        ("draft samples unrounded q, sends rounded q", dict(drafter=draft_by_mass_unrounded, wire_bits=3)),
        ("draft sends one token more than it samples from", dict(drafter=draft_by_mass_sends_one_more)),
        ("draft reuses the accept coin", dict(drafter=draft_by_mass_shares_accept_coin)),
        ("residual ignores q", dict(drafter=draft_by_mass(1e-3, 32), verifier=verify_recover_from_p)),
    ],
)
def test_first_token_broken_variants_with_q_by_mass_are_caught(name, kw):
    kw = {"wire_bits": 20, **kw}
    emitted, p = first_token(SamplingParams(temperature=1.5), 0, **kw)
    pv = chi2_pvalue(emitted, p)
    assert pv < FAIL_P, f"{name}: p-value {pv:.3g} (the test cannot see this bug)"


@pytest.mark.parametrize(
    "params, mass, wire_bits",
    [
        (SamplingParams(), (0.1, V3), 20),
        (SamplingParams(temperature=0.8, top_k=4, top_p=0.9), (1e-3, 2), 4),
    ],
    ids=["plain, heavy truncation", "filtered, budget binds, coarse grid"],
)
def test_joint_first_three_tokens_match_target_with_q_by_mass(params, mass, wire_bits):
    joint = exact_joint(params)
    seeds = torch.arange(B, dtype=I64) * 3 + 1
    for K in (1, 3):
        out = generate3(K, params, seeds, 0, wire_bits, drafter=draft_by_mass(*mass))
        pv = chi2_pvalue(_code3(out), joint)
        assert pv > PASS_P, f"K={K}: p-value {pv:.3g}"


def test_joint_broken_variant_with_q_by_mass_is_caught():
    params = SamplingParams()
    out = generate3(2, params, torch.arange(B, dtype=I64), 0, 20, drafter=draft_by_mass_sends_one_more)
    pv = chi2_pvalue(_code3(out), exact_joint(params))
    assert pv < FAIL_P, f"p-value {pv:.3g}"
