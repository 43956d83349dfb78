"""The largest values of a row on the host, without a top-k over the whole vocabulary.

torch.topk on the CPU copies the row into (value, index) pairs and partially
sorts them; for the sparse q's budget (up to 1,792 of a 32,000-token row, or
whatever carries the mass) that cost grows with k. The rows specd selects
from are skewed (a few hundred tokens carry the mass), so one pass can find a
small candidate set that provably holds the answer, and only the candidates
are sorted. (For a small k over a few rows, torch.topk is the faster one: the
draft's branch rankings, top 5-64 of 3 rows, took 0.20-0.29 ms with it
against 0.45-0.57 ms through these bins, host time measured in the draft
service of an emulated run on 2026-12-05; specd.core.draft.branching uses torch.topk.)

- A float32's bits, read as an integer and made monotone for negatives,
  order the values; their top 12 bits (sign, exponent, 3 mantissa bits) put
  each value in one of 4,096 bins, 1/8 of an octave wide. One np.bincount
  counts the row per bin.
- The candidates are the values from the highest bin down to the first bin b
  whose bins >= b hold at least k values (then the row's top k are among
  them: every value below b is smaller than every value from b up), or, for
  a non-negative row, whose lower bins hold at most `mass` in total (each
  lower bin's count times its upper edge bounds it).

The candidates are sorted by one np.sort of 64-bit keys (the value's order
bits above the candidate's position), so equal values keep the lower id
first. The values and ids returned are exactly the row's top k
(tests/unit/core/sampling/test_host_select.py checks them against torch.topk
on random and adversarial rows); only the order of equal values may differ.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["bins", "candidates", "mass_candidates", "top_sorted"]

_SHIFT = 20  # bits dropped: 32 - 20 = 12 bits of bin index
_HALF = 1 << (31 - _SHIFT)  # bins below this hold negative values


def _ordered(a: np.ndarray) -> np.ndarray:
    """[V] float32 -> [V] uint32 that orders like the values (-0.0 just below +0.0; NaNs at the ends)."""
    i = a.view(np.int32)
    ordered = i ^ ((i >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits flipped: int order == float order
    return ordered.view(np.uint32) ^ np.uint32(0x80000000)  # signed -> unsigned order


def bins(a: np.ndarray) -> np.ndarray:
    """[V] float32 -> [V] int64 bin in [0, 4096), non-decreasing in the value (-0.0 below +0.0; NaNs at the ends)."""
    return (_ordered(a) >> np.uint32(_SHIFT)).astype(np.int64)


def _upper_edges() -> np.ndarray:
    """[2048] float64: the value each non-negative bin ends below (bin b holds values in [edge b, edge b+1)).

    The bins of +inf and NaN get float32's largest value instead of +inf (a finite row has none)."""
    b = np.arange(1, _HALF + 1, dtype=np.int64)  # the next bin
    edges = np.full(_HALF, float(np.finfo(np.float32).max))
    finite = b < 0x7F8  # +inf's bits are 0x7F8 << 20
    edges[finite] = (b[finite] << _SHIFT).astype(np.uint32).view(np.float32).astype(np.float64)
    edges.flags.writeable = False  # a constant
    return edges


_UPPER = _upper_edges()


def _cumsum(x: np.ndarray) -> np.ndarray:
    """np.cumsum(x) by torch's kernel (the same left-to-right sums, ~3x faster on this host)."""
    return torch.from_numpy(x).cumsum(0).numpy()


def _first_bin(counts: np.ndarray, k: int, total_count: int) -> int:
    """The highest bin b whose bins below hold at most total_count - k values (so b and above hold >= k)."""
    return int(np.searchsorted(_cumsum(counts), total_count - min(k, total_count), side="right"))


def candidates(a: np.ndarray, k: int) -> np.ndarray:
    """Ids [n] (ascending) of the values from the highest bin down to the first whose bins hold the top k.

    a: [V] float32 row without NaN. n >= min(k, V); every value left out is below every one kept.
    """
    key = bins(a)  # [V]
    b = _first_bin(np.bincount(key, minlength=2 * _HALF), k, a.size)
    return np.flatnonzero(key >= min(b, 2 * _HALF - 1))


def mass_candidates(p: np.ndarray, k: int, mass: float) -> np.ndarray | None:
    """:func:`candidates` of a non-negative row p, stopping at the first bin that holds the top k or whose
    lower bins hold at most `mass` in total (each bin bounded by its count times its upper edge).

    p: [V] float32 (no NaN). For a non-negative row the bins are the bits' top 11 (no sign to
    order); a row with a negative value (or -0.0) is not one: None.
    """
    key = p.view(np.int32) >> _SHIFT  # [V] in [0, 2048) for p >= +0.0, negative otherwise
    try:
        counts = np.bincount(key, minlength=_HALF)  # [2048]
    except ValueError:  # a negative key: a negative value
        return None
    by_count = _first_bin(counts, k, p.size)
    by_mass = int(np.searchsorted(_cumsum(counts * _UPPER), mass, side="right"))  # bins below: <= mass
    return np.flatnonzero(key >= min(max(by_count, by_mass), _HALF - 1))


def top_sorted(a: np.ndarray, ids: np.ndarray, k: int, *, nonneg: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The largest min(k, n) of the values a[ids], most likely first: (values [m] float32, ids [m] int64).

    ids: [n] ascending (from :func:`candidates`); nonneg: the values are >= +0.0 (their bits order
    them as they are). One sort of 64-bit keys (numpy's vectorised sort, ~2.5x an argsort here):
    the value's order bits, inverted (largest first), above the candidate's position (ties: the
    lower id first).
    """
    vals = a[ids]  # [n]
    order = vals.view(np.uint32) if nonneg else _ordered(vals)  # [n] uint32, ascending with the value
    keys = (~order).astype(np.uint64) << np.uint64(32) | np.arange(ids.size, dtype=np.uint64)  # [n]
    if ids.size > k:
        keys = np.partition(keys, k - 1)[:k]  # the k largest values, unordered
    at = (np.sort(keys) & np.uint64(0xFFFFFFFF)).astype(np.intp)  # [m] positions, most likely first
    return vals[at], ids[at]
