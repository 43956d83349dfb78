"""The sparse proposal q a model draft sends and samples from: by mass, capped, on an integer grid.

Per draft position the draft keeps the fewest of its most likely tokens whose
mass reaches 1 - epsilon, never more than ``max_tokens`` (the budget),
renormalises them, rounds each to an integer *weight* on a 2**-bits grid, and
samples its token from exactly ``weights / sum(weights)`` (float64) — the
numbers it sends. q *is* then the proposal distribution, so speculative
sampling stays exact (ARCHITECTURE §3). What truncation costs is acceptance:
with a perfect draft (q = p) a position accepts with probability equal to the
mass kept, >= 1 - epsilon unless the budget binds.

Why integer weights on a fine grid (docs/results/sparse-q.md has the numbers):
at T = 1 the demo target spreads its mass over thousands of tokens, many of
them below 2**-17, which a 2**-16 grid rounds to 0; 2**-18 keeps most of them.
Weights are small integers, so on the wire they travel as varints, with the
token IDs sorted and sent as gaps (specd.core.sampling.compact_q): ~2.2 bytes
per kept token instead of ~6.7 for (uint32 id, float32 prob) pairs.

A fixed top-k (the old ``--wire-top-k``) is the special case epsilon = 0,
max_tokens = k (:meth:`QSettings.top_k`).

How the kept tokens are found does not change which they are: a float32 row on
the host takes a histogram of its values (specd.core.sampling.host_select) and
sorts only the candidates that provably hold its kept prefix; any other row
(on a GPU, of a vocabulary of at most 256 tokens, or one the histogram cannot
decide) a torch.topk of the budget.
Equal probabilities keep the lower id first on the host path; the rule, the
weights and the slot order are those of a full top-k (docs/results/sparse-q.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling import host_select
from specd.core.sampling.sampler import Role, host_coins

# Weights travel as float32 inside the core (Proposal.q_probs): integers up to
# 2**24 are exact there, so bits <= 24 and decoded weights above it are refused.
MAX_BITS = 24
MAX_WEIGHT = 1 << MAX_BITS


@dataclass(frozen=True)
class QSettings:
    """How a model draft truncates and rounds its q (DraftConfig: --q-epsilon, --q-max-tokens, --wire-bits)."""

    epsilon: float = 1e-3  # keep the fewest tokens whose mass reaches 1 - epsilon (0: every token, up to the budget)
    # Defaults chosen by scripts/sparse_q_sweep.py (docs/results/sparse-q.md): the
    # widest budget whose wire bytes stay under 4 KiB per draft token at p99.
    max_tokens: int = 1792  # budget: tokens sent per draft position, at most
    bits: int = 18  # weights are integers on a 2**-bits grid

    def validate(self) -> QSettings:
        if not (isinstance(self.epsilon, float | int) and 0.0 <= self.epsilon < 1.0):
            raise InvalidArgument(f"q epsilon must be in [0, 1) (got {self.epsilon!r})")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise InvalidArgument(f"q max tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not (isinstance(self.bits, int) and 1 <= self.bits <= MAX_BITS):
            raise InvalidArgument(f"wire bits must be an integer in 1..{MAX_BITS} (got {self.bits!r})")
        return self

    @classmethod
    def top_k(cls, k: int, bits: int = 18) -> QSettings:
        """A fixed top-k (the old --wire-top-k): no mass criterion, k tokens (those with q > 0)."""
        return cls(epsilon=0.0, max_tokens=k, bits=bits)


def build(probs: Tensor, settings: QSettings, total: np.ndarray | None = None) -> tuple[Tensor, Tensor]:
    """The sparse q of each row: what the draft sends and samples from.

    probs:   [A, V] float, the draft's processed distribution per row (rows sum to ~1)
    total:   [A] float64 probs.double().sum(-1) if the caller has it (sampler.sampled_mass)
    returns: (ids [A, W] int64, weights [A, W] float32) on the host, W = the widest row;
             slots by decreasing weight, each row's positive weights a prefix,
             unused slots id 0 with weight 0. q(ids[a, j]) = weights[a, j] / weights[a].sum().

    Row a keeps rank r (of its top max_tokens) iff its probability is > 0 and
    the mass strictly before r is < (1 - epsilon) * the row's total; the top
    token always. Kept values are renormalised (float64), weight =
    round(t * 2**bits) (half to even), the top weight at least 1; a slot that
    rounds to 0 is dropped. Rows never depend on their batch-mates.

    The passes over V run where probs live (the total and the top-k selection);
    the rest, over at most max_tokens slots per row, runs in numpy on the host,
    where the wire and the sampler need the numbers anyway.
    """
    assert probs.dim() == 2 and probs.shape[-1] > 0, f"probs must be [A, V], got {tuple(probs.shape)}"
    assert probs.is_floating_point(), f"probs must be floating point, got {probs.dtype}"
    settings.validate()
    A, V = probs.shape
    if A == 0:
        return torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.float32)
    k = min(settings.max_tokens, V)
    if total is None:
        total = probs.sum(-1, dtype=torch.float64).cpu().numpy()  # [A] (the same sum as probs.double().sum(-1))
    vals, ids = _top(probs, k, total, settings.epsilon)  # [A, n] each, most likely first
    ids, weights = _round(vals, ids, total, settings)
    return torch.from_numpy(ids), torch.from_numpy(weights)


def _round(vals: np.ndarray, ids: np.ndarray, total: np.ndarray, settings: QSettings) -> tuple[np.ndarray, np.ndarray]:
    """Truncate by mass, renormalise and round to the grid: (ids [A, W] int64, weights [A, W] float32).

    vals: [A, n] float32, each row's top values in decreasing order; ids: [A, n] their token ids;
    total: [A] float64 each row's whole mass. W = the widest row; unused slots id 0, weight 0.

    Row a keeps a prefix of its ranks (vals decrease, the mass before a rank grows): the positive
    ones before the first whose mass strictly before is >= (1 - epsilon) * total, the first always.
    The kept mass is the left-to-right cumulative sum at the row's last kept rank, so a row's
    numbers do not depend on how wide its batch-mates are. All rows at once: no loop over rows.
    """
    A, n = vals.shape
    rows = np.arange(A)
    v64 = vals.astype(np.float64)  # [A, n]
    csum = _cumsum(v64)  # [A, n] mass through each rank
    cut = (vals > 0).sum(axis=1)  # [A] zeros come last
    if settings.epsilon > 0:
        past = (csum - v64) >= (1.0 - settings.epsilon) * total[:, None]  # [A, n] mass before reaches the rule
        first = past.argmax(axis=1)  # [A] the first such rank (0 if there is none)
        cut = np.minimum(cut, np.where(past[rows, first], first, n))
    cut = np.maximum(cut, 1)  # [A]
    m = int(cut.max())  # the widest kept prefix: nothing past it is read
    kept = np.arange(m)[None, :] < cut[:, None]  # [A, m]
    mass = csum[rows, cut - 1]  # [A]
    weights = np.rint(np.where(kept, v64[:, :m], 0.0) / mass[:, None] * float(1 << settings.bits))  # half to even
    weights[:, 0] = np.maximum(weights[:, 0], 1.0)  # the row never vanishes
    # Weights do not increase along a row: its positive ones are a prefix (a slot that rounds to 0 is dropped).
    width = max(1, int((weights > 0).sum(axis=1).max()))
    out_w = weights[:, :width].astype(np.float32)
    out_ids = np.where(out_w > 0, ids[:, :width], 0)
    return out_ids, out_w


# The first selection's width: most rows' mass criterion ends within it (a partial top-k is
# far cheaper than the budget's 1792 at V = 32,000); wider rows take a second, full selection.
_FIRST_TOP = 256


def _within_mass(v64: np.ndarray, total: np.ndarray, epsilon: float) -> np.ndarray:
    """[A, n] bool: rank r of the sorted values is kept iff the mass strictly before it is < (1 - epsilon) total.

    v64: [A, n] float64 sorted values; total: [A] float64. The cumulative sum runs left to right
    (float64), as the reference's torch.cumsum does."""
    before = _cumsum(v64) - v64  # [A, n] mass strictly before each rank
    return before < (1.0 - epsilon) * total[:, None]


def _cumsum(x: np.ndarray) -> np.ndarray:
    """np.cumsum(x, axis=-1) by torch's kernel: the same left-to-right sums, ~3x faster on this host."""
    return torch.from_numpy(x).cumsum(-1).numpy()


def _top(probs: Tensor, k: int, total: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """The top values [A, n] float32 and ids [A, n] int64 of each row, most likely first, at least up to its last
    kept rank (n <= k); zeros past a row's own selection. Rows never depend on their batch-mates.

    float32 rows on the host take :func:`_select_host` (one histogram pass over V, then a
    selection among its candidates); the others, and any row it declines, a top-k where they live.
    So do rows no wider than the first selection (a small vocabulary: the statistical tests'), where one
    top-k for the whole batch costs less than a selection per row; which path a row takes depends on V only.
    """
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.shape[-1] <= _FIRST_TOP:
        return _top_k(probs, k, total, epsilon)
    a = probs.detach().numpy()  # [A, V]
    picked = [_select_host(a[i], float(total[i]), k, epsilon) for i in range(a.shape[0])]
    declined = [i for i, row in enumerate(picked) if row is None]
    if declined:
        idx = torch.tensor(declined, dtype=torch.int64)
        vals, ids = _top_k(probs[idx], k, total[declined], epsilon)
        for r, i in enumerate(declined):
            picked[i] = (vals[r], ids[r])
    n = max(len(row[0]) for row in picked if row is not None)
    out_vals = np.zeros((a.shape[0], n), dtype=np.float32)
    out_ids = np.zeros((a.shape[0], n), dtype=np.int64)
    for i, row in enumerate(picked):
        assert row is not None
        out_vals[i, : len(row[0])], out_ids[i, : len(row[1])] = row
    return out_vals, out_ids


def _top_k(probs: Tensor, k: int, total: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """_top by torch.topk where probs live: [A, n] values and ids, n = k or _FIRST_TOP.

    With a mass criterion, a row whose first _FIRST_TOP ranks already end its kept prefix (the
    last of them is not kept) needs no more: cumulative mass only grows, so no later rank is kept
    either. Only the other rows take the full top-k.
    """
    first = min(k, _FIRST_TOP)
    if epsilon <= 0 or first == k:
        return _host(torch.topk(probs, k, dim=-1))
    vals, ids = _host(torch.topk(probs, first, dim=-1))  # [A, first]
    wide = _within_mass(vals.astype(np.float64), total, epsilon)[:, -1]  # [A]: may keep rank `first` or later
    if not wide.any():
        return vals, ids
    out_vals = np.zeros((probs.shape[0], k), dtype=vals.dtype)
    out_ids = np.zeros((probs.shape[0], k), dtype=ids.dtype)
    out_vals[:, :first], out_ids[:, :first] = vals, ids
    rows = np.flatnonzero(wide)
    out_vals[rows], out_ids[rows] = _host(torch.topk(probs[torch.from_numpy(rows).to(probs.device)], k, dim=-1))
    return out_vals, out_ids


# The mass the candidates may leave out, as a share of epsilon * total (the rest is margin for
# float64 rounding: the kept prefix is checked exactly afterwards anyway).
_COVER = 0.99


def _select_host(a: np.ndarray, total: float, k: int, epsilon: float) -> tuple[np.ndarray, np.ndarray] | None:
    """One row's top values [n] float32 and ids [n] int64 (most likely first), through its last kept rank, or None.

    a: [V] float32, the row; total: its float64 sum. The candidates (specd.core.sampling.host_select)
    hold the row's top k, or leave out at most _COVER * epsilon * total of its mass; only they are
    sorted. Candidates short of k values must reach the mass criterion in their own sorted prefix
    sum (the one `_within_mass` computes), or the rank after them could still be kept: None. So is
    a row that is not finite and non-negative: the caller takes the full top-k.
    """
    if not (math.isfinite(total) and total > 0):  # a NaN or an infinity makes the total one too
        return None
    ids = host_select.mass_candidates(a, k, _COVER * epsilon * total)  # [n] ascending
    if ids is None:  # a negative value
        return None
    vals, ids = host_select.top_sorted(a, ids, k, nonneg=True)  # [min(n, k)] each, most likely first
    if ids.size < k and epsilon > 0 and not _cumsum(vals.astype(np.float64))[-1] >= (1.0 - epsilon) * total:
        return None
    return vals, ids


def _host(top: tuple[Tensor, Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """A topk's (values, indices) as host arrays: float32 values, int64 ids."""
    return top[0].float().cpu().numpy(), top[1].cpu().numpy()


def draft(
    probs: Tensor, settings: QSettings, seeds: Tensor, positions: Tensor, total: np.ndarray | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter's step for A rows at once: build q, then sample from exactly it.

    probs:     [A, V] the draft's processed distribution
    seeds:     [A] int64 request seeds
    positions: [A] int64 absolute position of the token being drafted
    total:     [A] float64 each row's mass, if the caller has it (see build)
    returns:   (token [A] int64 column index into V, ids [A, W] int64, weights [A, W] float32), on the host
    """
    assert seeds.shape == positions.shape == probs.shape[:1], (
        f"seeds and positions must be [A]={tuple(probs.shape[:1])}, got {tuple(seeds.shape)}, {tuple(positions.shape)}"
    )
    ids, weights = build(probs, settings, total)
    u = host_coins(seeds.cpu().numpy(), positions.cpu().numpy()[:, None], Role.DRAFT)[:, 0]  # [A] the draft's coins
    slot = sample_slots(weights.numpy(), u)  # [A]
    return torch.from_numpy(np.take_along_axis(ids.numpy(), slot[:, None], -1)[:, 0]), ids, weights


def sample_slots(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of a slot per row from integer weights: exactly sampler.sample_sparse's answer.

    weights: [A, W] float32 integer-valued, >= 0, each row with a positive one; u: [A] float64 coins
    returns: [A] int64 slot indices. q = weights / sum (float64; the sum of integers is exact in
    any order), cdf = its left-to-right cumulative sum, the slot is the first whose cdf exceeds
    u * cdf[-1], else the last with weight > 0 (u * total rounded up to the total).
    """
    w = weights.astype(np.float64)  # [A, W]
    cdf = _cumsum(w / w.sum(-1, keepdims=True))  # [A, W]
    slot = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # [A] the first index with cdf > u * total
    over = slot >= w.shape[-1]
    if over.any():
        last = w.shape[-1] - 1 - np.argmax((w > 0)[:, ::-1], axis=-1)  # [A] the last slot with weight > 0
        slot = np.where(over, last, slot)
    return slot.astype(np.int64)
