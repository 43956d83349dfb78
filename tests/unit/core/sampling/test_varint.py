"""Packed varints (specd.core.sampling.varint): protobuf's own bytes, read back exactly, malformed ones refused."""

from __future__ import annotations

import numpy as np
import pytest

from specd.core.errors import InvalidArgument
from specd.core.sampling import varint
from specd.v1 import common_pb2


def _payload(data: bytes) -> bytes:
    i = 1  # the tag
    length = shift = 0
    while True:  # the length varint
        b = data[i]
        length |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if b < 0x80:
            break
    assert len(data) == i + length
    return data[i:]


@pytest.mark.parametrize("seed", range(20))
def test_rows_encode_to_protobufs_own_packed_bytes_and_decode_back(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 2**32, size=int(rng.integers(0, 40))) >> int(rng.integers(0, 33)) for _ in range(4)]
    for values, data in zip(rows, varint.encode_rows(rows)):
        assert data == (
            _payload(common_pb2.SparseDistribution(token_ids=values.tolist()).SerializeToString())
            if len(values)
            else b""
        )
        assert varint.decode(data, "q").tolist() == values.tolist()
        assert varint.count(data) == len(values)


def test_edges_of_each_byte_length() -> None:
    values = np.array([0, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**32 - 1])
    data = varint.encode(values)
    assert len(data) == 1 + 1 + 2 + 2 + 3 + 3 + 4 + 4 + 5 + 5
    assert varint.decode(data, "q").tolist() == values.tolist()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes([0x81]), "cut off"),
        (bytes([0x80] * 5 + [0x01]), "longer than 5 bytes"),
        (bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x7F]), "past 32 bits"),
    ],
)
def test_malformed_varints_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        varint.decode(data, "q")
