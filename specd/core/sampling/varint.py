"""Packed varints in numpy: the bytes of a protobuf `repeated uint32` field's packed payload.

The compact sparse q (specd.core.sampling.compact_q) travels as two such byte strings per
draft position: the very bytes a packed repeated field puts on the wire, built and read here
in a few vectorised passes over all rows at once instead of one Python int per entry
(thousands per position at T > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from specd.core.errors import InvalidArgument

MAX_BYTES = 5  # a uint32 takes at most five 7-bit groups
_LIMITS = (1 << 7, 1 << 14, 1 << 21, 1 << 28)  # a value at or above limit j takes more than j + 1 bytes


def encode_rows(rows: Sequence[np.ndarray]) -> list[bytes]:
    """Each row's packed varint bytes (rows: integer arrays of values in [0, 2**32)), in one pass over all."""
    if not rows:
        return []
    v = np.concatenate([np.asarray(r, dtype=np.uint32) for r in rows])  # [N]
    row_ends = np.cumsum([len(r) for r in rows])  # [A] one past each row's last value
    if v.size == 0:
        return [b"" for _ in rows]
    if int(v.max()) < _LIMITS[0]:  # one byte each (most id gaps, small weights): the bytes are the values
        return _split(v.astype(np.uint8).tobytes(), np.concatenate(([0], row_ends)))
    n = np.ones(v.size, dtype=np.int64)  # [N] bytes per value
    for limit in _LIMITS:
        n += v >= limit
    ends = np.cumsum(n)  # [N] one past each value's last byte
    k = np.arange(int(ends[-1])) - np.repeat(ends - n, n)  # [B] byte index within its value
    out = (np.repeat(v, n) >> (7 * k).astype(np.uint32)).astype(np.uint8) & 0x7F  # [B]
    last = np.zeros(out.size, dtype=bool)
    last[ends - 1] = True
    out[~last] |= 0x80  # continuation bits
    return _split(out.tobytes(), np.concatenate(([0], ends))[np.concatenate(([0], row_ends))])


def encode(values: np.ndarray) -> bytes:
    """The packed varint bytes of non-negative integers below 2**32."""
    return encode_rows([values])[0]


def count(data: bytes) -> int:
    """How many varints the bytes hold (the bytes without a continuation bit)."""
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) < 0x80))


def decode(data: bytes, what: str) -> np.ndarray:
    """The integers of packed varint bytes -> [N] int64, or InvalidArgument naming `what` when malformed."""
    return decode_rows([data], what)[0]


def decode_rows(rows: Sequence[bytes], what: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows' integers in one pass -> ([N] int64 values in row order, [A] how many each row holds).

    InvalidArgument naming `what` (and the row) when a row ends inside a varint, a varint is
    longer than five bytes, or a value does not fit 32 bits."""
    for i, data in enumerate(rows):
        if data and data[-1] & 0x80:
            raise InvalidArgument(f"{what} at draft position {i}: the last varint is cut off")
    b = np.frombuffer(b"".join(rows), dtype=np.uint8)  # [B]
    ends = np.flatnonzero(b < 0x80)  # [N] each value's last byte
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # [A] bytes per row
    per_row = np.diff(np.searchsorted(ends, np.cumsum(lengths)), prepend=0)  # [A] values per row
    if ends.size == b.size:  # one byte each
        return b.astype(np.int64), per_row
    starts = np.empty_like(ends)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    sizes = ends - starts + 1
    longest = int(sizes.max())
    if longest > MAX_BYTES:
        raise InvalidArgument(f"{what}: a varint longer than {MAX_BYTES} bytes")
    out = (b[starts] & 0x7F).astype(np.int64)  # [N]
    for j in range(1, longest):  # the j-th 7-bit group of the values that have one
        has = sizes > j
        out[has] |= (b[starts[has] + j] & 0x7F).astype(np.int64) << (7 * j)
    if int(out.max()) >= 1 << 32:
        raise InvalidArgument(f"{what}: a value past 32 bits")
    return out, per_row


def _split(data: bytes, cuts: np.ndarray) -> list[bytes]:
    """data cut at the [A + 1] byte offsets: A rows."""
    return [data[a:b] for a, b in pairwise(cuts.tolist())]
