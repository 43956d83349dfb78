"""The compact wire form of a sparse q (specd.core.sampling.compact_q): round trips, checks, all rows at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.sampling import compact_q, sparse_q, varint
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sparse_q import MAX_WEIGHT, QSettings
from specd.serving.wire import proposal_from_proto, proposal_to_proto, q_wire_bytes
from specd.v1 import common_pb2, draft_pb2

# ---- the compact wire form ---------------------------------------------------


def test_compact_form_round_trips_and_merges_duplicates() -> None:
    ids = torch.tensor([[40, 3, 17, 0, 3, 9], [5, 2, 0, 0, 0, 0]])
    w = torch.tensor([[5.0, 2.0, 1000.0, 0.0, 1.0, 7.0], [1.0, 300.0, 0.0, 0.0, 0.0, 0.0]])  # id 3 twice, zero slots
    (gaps, ints), (gaps2, ints2) = compact_q.to_compact(ids, w)
    assert varint.decode(gaps, "g").tolist() == [3, 6, 8, 23] and varint.decode(ints, "w").tolist() == [3, 7, 1000, 5]
    assert (varint.decode(gaps2, "g").tolist(), varint.decode(ints2, "w").tolist()) == ([2, 3], [300, 1])
    assert compact_q.compact_entries(gaps, ints) == (4, 4)
    ids, weights = compact_q.from_compact(gaps, ints, 41)
    assert (ids.tolist(), weights.tolist()) == ([3, 9, 17, 40], [3.0, 7.0, 1000.0, 5.0])


def test_the_rows_of_many_proposals_encode_as_each_alone() -> None:
    g = torch.Generator().manual_seed(5)
    qs = []
    for k, width in ((2, 1792), (1, 7), (3, 300)):  # a branch call's proposals: different K and widths
        probs = torch.softmax(torch.randn(k, 32000, generator=g) * 3, -1)
        qs.append(sparse_q.build(probs, QSettings(max_tokens=width)))
    qs.append((torch.tensor([[7, 7, 2, 0]]), torch.tensor([[3.0, 4.0, 9.0, 0.0]])))  # a repeated id, a dead slot
    assert compact_q.to_compact_each(qs) == [compact_q.to_compact(ids, w) for ids, w in qs]
    assert compact_q.to_compact_each([]) == []


def test_large_ids_and_weights_keep_their_order_in_the_sort_keys() -> None:
    ids = torch.tensor([[2**31 - 1, 0, 2**20]])
    w = torch.tensor([[float(MAX_WEIGHT), 1.0, float(MAX_WEIGHT - 1)]])
    ((gaps, ints),) = compact_q.to_compact(ids, w)
    assert varint.decode(gaps, "g").tolist() == [0, 2**20, 2**31 - 1 - 2**20]
    assert varint.decode(ints, "w").tolist() == [1, MAX_WEIGHT - 1, MAX_WEIGHT]


@pytest.mark.parametrize(
    "gaps, weights, match",
    [
        ([1, 0], [1, 1], "gaps after the first"),
        ([1, 2], [1], "equal, non-zero"),
        ([], [], "equal, non-zero"),
        ([1], [MAX_WEIGHT + 1], "weights must be"),
        ([30, 20], [1, 1], "outside the vocabulary"),
    ],
)
def test_malformed_compact_q_is_refused(gaps, weights, match) -> None:
    with pytest.raises(InvalidArgument, match=match):
        compact_q.from_compact(varint.encode(np.array(gaps)), varint.encode(np.array(weights)), 49)


def test_wire_sends_integer_weights_compactly_and_float_probs_plainly() -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(4, 5000, generator=g) * 1.2, -1)
    tok, ids, w = sparse_q.draft(
        p, QSettings(epsilon=1e-3, max_tokens=1000), torch.arange(4), torch.zeros(4, dtype=torch.int64)
    )
    proposal = Proposal(tok.tolist(), ids, w)
    msg = proposal_to_proto(proposal)
    assert all(d.id_gaps and not d.token_ids for d in msg.q)
    back = proposal_from_proto(msg, 5000)
    for k in range(4):  # the same q, per token
        assert _kept(back.q_ids[k], back.q_probs[k]) == _kept(ids[k], w[k])
    plain = Proposal(tok.tolist(), ids, w / w.sum(-1, keepdim=True))  # float probabilities: the plain form
    plain_msg = proposal_to_proto(plain)
    assert all(d.token_ids and not d.id_gaps for d in plain_msg.q)
    # the compact form is much smaller for the same tokens
    assert sum(q_wire_bytes(msg)) < 0.6 * sum(q_wire_bytes(plain_msg))
    assert sum(q_wire_bytes(msg)) == draft_pb2.DraftProposal(q=msg.q).ByteSize()  # tags and lengths included


def test_a_q_that_mixes_both_forms_is_refused() -> None:
    d = common_pb2.SparseDistribution(token_ids=[1], probs=[1.0], id_gaps=b"\x01", weights=b"\x01")
    with pytest.raises(InvalidArgument, match="exactly one of the plain and the compact form"):
        proposal_from_proto(draft_pb2.DraftProposal(token_ids=[1], q=[d]), 10)


def _kept(ids: torch.Tensor, weights: torch.Tensor) -> dict[int, float]:
    return {int(i): float(w) for i, w in zip(ids, weights) if w > 0}


@pytest.mark.parametrize("seed", range(6))
def test_the_dense_decode_of_all_rows_equals_decoding_each_row(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(5, 3000, generator=g) * (0.5 + seed), -1)
    tok, ids, w = sparse_q.draft(
        p, QSettings(epsilon=1e-3, max_tokens=900), torch.arange(5), torch.zeros(5, dtype=torch.int64)
    )
    rows = compact_q.to_compact(ids, w)
    q_ids, q_probs = compact_q.dense_from_compact(rows, 3000, tok.tolist())
    for k, (gaps, weights) in enumerate(rows):
        one_ids, one_w = compact_q.from_compact(gaps, weights, 3000)
        assert _kept(q_ids[k], q_probs[k]) == _kept(one_ids, one_w) == _kept(ids[k], w[k])


@pytest.mark.parametrize(
    ("rows", "tokens", "match"),
    [
        ([([1, 2], [0, 0])], [1], "not all 0"),
        ([([1, 2], [5, 0])], [3], "draft token 3 at position 0 has probability 0"),
        ([([1], [5]), ([4], [1])], [1, 5], "draft token 5 at position 1 has probability 0"),
        ([([1], [5]), ([], [])], [1, 5], "equal, non-zero"),
    ],
)
def test_the_dense_decode_checks_each_row_as_proposal_from_wire_does(rows, tokens, match) -> None:
    packed = [(varint.encode(np.array(g)), varint.encode(np.array(w))) for g, w in rows]
    with pytest.raises(InvalidArgument, match=match):
        compact_q.dense_from_compact(packed, 50, tokens)
