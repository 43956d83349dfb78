"""The compact wire form of a sparse q: per draft position, sorted token ids as gaps and integer weights.

A model draft's q (specd.core.sampling.sparse_q) has integer weights on a 2**-bits grid. On
the wire each position's kept tokens travel sorted by id, as gaps (the first id, then the
difference to the one before, >= 1), with their weights; both as packed varints
(specd.core.sampling.varint), so small gaps and small weights take one byte each: about
2.2 bytes per kept token. The probability of the i-th listed token is weights[i] / sum(weights).

Both ends work on all of a proposal's positions at once: the draft encodes its K rows in
one pass, and the target decodes and checks them into the dense [K, W] tensors the
rejection sampler reads, without a Python int per entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling import varint
from specd.core.sampling.sparse_q import MAX_WEIGHT

CompactRow = tuple[bytes, bytes]  # (id gaps, weights), packed varints

_WEIGHT_BITS = np.uint64(MAX_WEIGHT.bit_length())  # a weight (<= MAX_WEIGHT) fits these low bits of a sort key
_WEIGHT_MASK = np.uint64((1 << MAX_WEIGHT.bit_length()) - 1)
_ID_LIMIT = 1 << (63 - MAX_WEIGHT.bit_length())  # ids below this leave every live key under a dead slot's (max)


def is_integral(weights: Tensor) -> bool:
    """True if every weight is an integer in [0, MAX_WEIGHT] (the compact form can carry them exactly)."""
    return bool(((weights == torch.round(weights)) & (weights >= 0) & (weights <= MAX_WEIGHT)).all())


def to_compact(ids: Tensor, weights: Tensor) -> list[CompactRow]:
    """Each position's q as (id gaps, integer weights), packed varint bytes, zero-weight slots dropped.

    ids: [A, W] int64; weights: [A, W] integer-valued (see is_integral). A repeated id in a
    row is sent once with its weights added. All rows are sorted and encoded in one pass.
    """
    assert ids.shape == weights.shape and ids.dim() == 2, f"ids and weights must be [A, W], got {tuple(ids.shape)}"
    A, W = ids.shape
    if A == 0:
        return []
    raw_w = weights.numpy()  # [A, W]
    live = raw_w > 0
    w = np.where(live, raw_w, 0).astype(np.uint64)  # (a negative weight is a dead slot, as before)
    # Sort each row by id with its dead slots last, then keep the live prefix: one sort of 64-bit
    # keys (id above the weight's 25 bits; a dead slot past any id), ~10x a stable argsort here.
    raw = ids.numpy()
    assert raw.size == 0 or (int(raw.min()) >= 0 and int(raw.max()) < _ID_LIMIT), "token ids out of range"
    keys = np.where(live, raw.astype(np.uint64) << _WEIGHT_BITS | w, np.uint64(np.iinfo(np.uint64).max))
    keys.sort(axis=-1)  # [A, W]
    sorted_ids = (keys >> _WEIGHT_BITS).astype(np.int64)
    sorted_w = (keys & _WEIGHT_MASK).astype(np.int64)
    counts = live.sum(-1)  # [A] kept entries per row
    kept = np.arange(W)[None, :] < counts[:, None]  # [A, W] the live prefix of each sorted row
    repeated = kept[:, 1:] & (sorted_ids[:, 1:] == sorted_ids[:, :-1])  # [A, W - 1]
    gaps = np.diff(sorted_ids, axis=-1, prepend=0)  # [A, W]
    gap_rows = [gaps[a, : counts[a]] for a in range(A)]
    weight_rows = [sorted_w[a, : counts[a]] for a in range(A)]
    for a in np.flatnonzero(repeated.any(-1)):  # rare: one entry per id, its weights added
        unique, inverse = np.unique(sorted_ids[a, : counts[a]], return_inverse=True)
        gap_rows[a] = np.diff(unique, prepend=0)
        weight_rows[a] = np.bincount(inverse, weights=sorted_w[a, : counts[a]]).astype(np.int64)
    return list(zip(varint.encode_rows(gap_rows), varint.encode_rows(weight_rows)))


def to_compact_each(qs: Sequence[tuple[Tensor, Tensor]]) -> list[list[CompactRow]]:
    """to_compact of each (ids [K_i, W_i], weights [K_i, W_i]), all rows encoded in one pass.

    A branch call's proposals have different widths: their rows are padded with dead slots
    (weight 0, dropped by to_compact) to the widest, stacked, encoded once and split again.
    """
    if not qs:
        return []
    width = max(int(ids.shape[1]) for ids, _ in qs)
    ids = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in qs])  # [sum K_i, W]
    weights = torch.cat([torch.nn.functional.pad(w, (0, width - w.shape[1])) for _, w in qs])
    rows = to_compact(ids, weights)
    ends = np.cumsum([int(i.shape[0]) for i, _ in qs])
    return [rows[end - int(i.shape[0]) : end] for end, (i, _) in zip(ends, qs)]


def compact_entries(gaps: bytes, weights: bytes) -> tuple[int, int]:
    """How many id gaps and weights a compact row holds (from its bytes, without decoding it)."""
    return varint.count(gaps), varint.count(weights)


def from_compact(gaps: bytes, weights: bytes, vocab_size: int) -> tuple[Tensor, Tensor]:
    """One row: (ids [W] int64, weights [W] float32), or InvalidArgument saying what is wrong."""
    ids, w, _ = _decode([(gaps, weights)], vocab_size)
    return torch.from_numpy(ids), torch.from_numpy(w.astype(np.float32))


def dense_from_compact(rows: Sequence[CompactRow], vocab_size: int, tokens: Sequence[int]) -> tuple[Tensor, Tensor]:
    """A proposal's q from its compact rows -> (q_ids [K, W] int64, q_probs [K, W] float32), zero-padded.

    Checked as Proposal.from_wire checks rows, all rows at once: each decodes, its ids
    increase within the vocabulary, its weights are in [0, MAX_WEIGHT] and not all 0, and
    draft token i has a positive weight in row i. InvalidArgument names the first fault.
    """
    ids, w, per_row = _decode(rows, vocab_size)
    k = len(rows)
    starts = np.concatenate(([0], np.cumsum(per_row)[:-1]))  # [K] each row's first entry
    row_of = np.repeat(np.arange(k), per_row)  # [N]
    mass = np.add.reduceat(w, starts) if ids.size else np.zeros(k, dtype=np.int64)  # [K]
    if (mass <= 0).any():
        i = int(np.flatnonzero(mass <= 0)[0])
        raise InvalidArgument(f"q at draft position {i}: probabilities must be finite, >= 0 and not all 0")
    own = (ids == np.asarray(tokens, dtype=np.int64)[row_of]) & (w > 0)  # [N] the row's own token, weighted
    has_own = np.logical_or.reduceat(own, starts)  # [K]
    if not has_own.all():
        i = int(np.flatnonzero(~has_own)[0])
        raise InvalidArgument(f"draft token {tokens[i]} at position {i} has probability 0 in its own q")
    width = int(per_row.max())
    col = np.arange(ids.size) - starts[row_of]  # [N] slot within its row
    q_ids = np.zeros((k, width), dtype=np.int64)
    q_probs = np.zeros((k, width), dtype=np.float32)
    q_ids[row_of, col] = ids
    q_probs[row_of, col] = w
    return torch.from_numpy(q_ids), torch.from_numpy(q_probs)


def _decode(rows: Sequence[CompactRow], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All rows' (ids [N], weights [N]) and entries per row [K], checked as a compact q's."""
    gaps, gaps_per_row = varint.decode_rows([g for g, _ in rows], "compact q id gaps")
    w, w_per_row = varint.decode_rows([w for _, w in rows], "compact q weights")
    if not (gaps_per_row == w_per_row).all() or (gaps_per_row == 0).any():
        raise InvalidArgument("compact q needs equal, non-zero numbers of id gaps and weights")
    starts = np.concatenate(([0], np.cumsum(gaps_per_row)[:-1]))  # [K]
    first = np.zeros(gaps.size, dtype=bool)
    first[starts] = True
    if (gaps[~first] < 1).any():
        raise InvalidArgument("compact q: id gaps after the first must be >= 1 (ids increase, each once)")
    if (w > MAX_WEIGHT).any():
        raise InvalidArgument(f"compact q: weights must be integers in [0, {MAX_WEIGHT}]")
    total = np.cumsum(gaps)  # [N] running sum over all rows; each row restarts at its first gap
    before = np.where(starts > 0, total[starts - 1], 0)  # [K] the sum up to the row's start
    ids = total - np.repeat(before, gaps_per_row)
    if (ids[np.cumsum(gaps_per_row) - 1] >= vocab_size).any():
        raise InvalidArgument(f"compact q names a token id outside the vocabulary [0, {vocab_size})")
    return ids, w, gaps_per_row
