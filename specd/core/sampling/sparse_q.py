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
token IDs sorted and sent as gaps (see :func:`to_compact`): ~2.2 bytes per
kept token instead of ~6.7 for (uint32 id, float32 prob) pairs.

A fixed top-k (the old ``--wire-top-k``) is the special case epsilon = 0,
max_tokens = k (:meth:`QSettings.top_k`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling.sampler import Role, coins, sample_sparse

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


def build(probs: Tensor, settings: QSettings) -> tuple[Tensor, Tensor]:
    """The sparse q of each row: what the draft sends and samples from.

    probs:   [A, V] float, the draft's processed distribution per row (rows sum to ~1)
    returns: (ids [A, W] int64, weights [A, W] float32), W = the widest row;
             slots by decreasing weight, each row's positive weights a prefix,
             unused slots id 0 with weight 0. q(ids[a, j]) = weights[a, j] / weights[a].sum().

    Row a keeps rank r (of its top max_tokens) iff its probability is > 0 and
    the mass strictly before r is < (1 - epsilon) * the row's total; the top
    token always. Kept values are renormalised (float64), weight =
    round(t * 2**bits) (half to even), the top weight at least 1; a slot that
    rounds to 0 is dropped. Rows never depend on their batch-mates.
    """
    assert probs.dim() == 2 and probs.shape[-1] > 0, f"probs must be [A, V], got {tuple(probs.shape)}"
    assert probs.is_floating_point(), f"probs must be floating point, got {probs.dtype}"
    settings.validate()
    A, V = probs.shape
    if A == 0:
        return torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.float32)
    k = min(settings.max_tokens, V)
    total = probs.to(torch.float64).sum(-1, keepdim=True)  # [A, 1]
    vals, ids = _top(probs, k, total, settings.epsilon)  # [A, k] each, most likely first
    v64 = vals.to(torch.float64)
    keep = vals > 0  # [A, k] (a prefix: vals decrease)
    if settings.epsilon > 0:
        keep &= _within_mass(v64, total, settings.epsilon)
    keep[:, 0] = True
    kept = torch.where(keep, v64, 0.0)  # [A, k]
    t = kept / kept.sum(-1, keepdim=True)  # truncated, renormalised
    weights = torch.round(t * float(1 << settings.bits))  # [A, k] non-increasing along a row
    weights[:, 0] = torch.clamp(weights[:, 0], min=1.0)  # the row never vanishes
    width = max(1, int((weights > 0).sum(-1).max()))
    weights, ids = weights[:, :width], ids[:, :width]
    ids = torch.where(weights > 0, ids, 0)
    return ids.to(torch.int64), weights.to(torch.float32)


# The first selection's width: most rows' mass criterion ends within it (a partial top-k is
# far cheaper than the budget's 1792 at V = 32,000); wider rows take a second, full selection.
_FIRST_TOP = 256


def _within_mass(v64: Tensor, total: Tensor, epsilon: float) -> Tensor:
    """[A, n] bool: rank r of the sorted values is kept iff the mass strictly before it is < (1 - epsilon) total."""
    before = torch.cumsum(v64, dim=-1) - v64  # [A, n] mass strictly before each rank
    return before < (1.0 - epsilon) * total


def _top(probs: Tensor, k: int, total: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """The top-k values and ids of each row, or zeros past a row's last kept rank.

    With a mass criterion, a row whose first _FIRST_TOP ranks already end its kept prefix (the
    last of them is not kept) needs no more: cumulative mass only grows, so no later rank is kept
    either. Only the other rows take the full top-k. Rows never depend on their batch-mates.
    """
    first = min(k, _FIRST_TOP)
    if epsilon <= 0 or first == k:
        return torch.topk(probs, k, dim=-1)
    vals, ids = torch.topk(probs, first, dim=-1)  # [A, first]
    wide = _within_mass(vals.to(torch.float64), total, epsilon)[:, -1]  # [A]: may keep rank `first` or later
    out_vals = torch.zeros(probs.shape[0], k, dtype=vals.dtype)
    out_ids = torch.zeros(probs.shape[0], k, dtype=ids.dtype)
    out_vals[:, :first], out_ids[:, :first] = vals, ids
    if bool(wide.any()):
        out_vals[wide], out_ids[wide] = torch.topk(probs[wide], k, dim=-1)
    return out_vals, out_ids


def draft(probs: Tensor, settings: QSettings, seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter's step for A rows at once: build q, then sample from exactly it.

    probs:     [A, V] the draft's processed distribution
    seeds:     [A] int64 request seeds
    positions: [A] int64 absolute position of the token being drafted
    returns:   (token [A] int64 column index into V, ids [A, W] int64, weights [A, W] float32)
    """
    assert seeds.shape == positions.shape == probs.shape[:1], (
        f"seeds and positions must be [A]={tuple(probs.shape[:1])}, got {tuple(seeds.shape)}, {tuple(positions.shape)}"
    )
    ids, weights = build(probs, settings)
    u = coins(seeds, positions[:, None], Role.DRAFT)[:, 0]  # [A] the draft's own coin
    return sample_sparse(ids, weights, u), ids, weights


# --------------------------------------------------------------------------
# Compact wire form
# --------------------------------------------------------------------------


def is_integral(weights: Tensor) -> bool:
    """True if every weight is an integer in [0, MAX_WEIGHT] (the compact form can carry them exactly)."""
    return bool(((weights == torch.round(weights)) & (weights >= 0) & (weights <= MAX_WEIGHT)).all())


def to_compact(ids: Tensor, weights: Tensor) -> tuple[list[int], list[int]]:
    """One position's q as (id gaps, integer weights), zero-weight slots dropped.

    ids: [W] int64; weights: [W] integer-valued (see is_integral).
    The kept tokens are sorted by id; gaps[0] is the first id, gaps[j] the
    difference to the previous id (>= 1: an id appears once; duplicate ids are
    merged, their weights added). Small gaps and small weights are one-byte varints.
    """
    assert ids.shape == weights.shape and ids.dim() == 1, f"ids and weights must be [W], got {tuple(ids.shape)}"
    live = weights > 0
    order_ids, inverse = torch.unique(ids[live], sorted=True, return_inverse=True)  # [M] increasing
    merged = torch.zeros(order_ids.shape[0], dtype=torch.float64).index_add_(0, inverse, weights[live].double())
    gaps = torch.diff(order_ids, prepend=order_ids.new_zeros(1))
    return gaps.tolist(), merged.to(torch.int64).tolist()


def from_compact(gaps: Sequence[int], weights: Sequence[int], vocab_size: int) -> tuple[Tensor, Tensor]:
    """(ids [W] int64, weights [W] float32) from the compact form, or InvalidArgument saying what is wrong.

    Decoded in numpy from the wire's repeated fields (no Python list per row: the target decodes
    every draft position of every verify)."""
    if len(gaps) != len(weights) or not gaps:
        raise InvalidArgument("compact q needs equal, non-zero numbers of id gaps and weights")
    g = np.asarray(gaps, dtype=np.int64)  # [W]
    w = np.asarray(weights, dtype=np.int64)  # [W]
    if (g[1:] < 1).any() or (g < 0).any():
        raise InvalidArgument("compact q: id gaps after the first must be >= 1 (ids increase, each once)")
    if (w < 0).any() or (w > MAX_WEIGHT).any():
        raise InvalidArgument(f"compact q: weights must be integers in [0, {MAX_WEIGHT}]")
    ids = np.cumsum(g)
    if int(ids[-1]) >= vocab_size:
        raise InvalidArgument(f"compact q names a token id outside the vocabulary [0, {vocab_size})")
    return torch.from_numpy(ids), torch.from_numpy(w.astype(np.float32))
