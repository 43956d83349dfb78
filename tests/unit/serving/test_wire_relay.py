"""The coordinator relays a draft's q to the target undecoded: same bytes out, shape checked, numbers left to the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.rounds import steps
from specd.core.sampling import sparse_q, varint
from specd.core.sampling.proposal import Proposal
from specd.serving import wire
from specd.v1 import common_pb2, draft_pb2

V = 1000


def _model_proposal() -> Proposal:
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(4)) * 3, dim=-1)
    ids, weights = sparse_q.build(probs, sparse_q.QSettings())
    tokens = [int(i) for i in ids[:, 0]]  # each row's most likely token: positive weight in its own q
    return Proposal(tokens, ids, weights, compute_ms=1.5)


def test_a_relayed_q_reaches_the_target_byte_for_byte() -> None:
    sent = wire.proposal_to_proto(_model_proposal())
    relayed = wire.proposal_from_proto(draft_pb2.DraftProposal.FromString(sent.SerializeToString()), V, relay=True)
    assert relayed.q_ids is None and relayed.wire_q is not None and len(relayed.wire_q) == 3
    decoded = wire.proposal_from_proto(sent, V)
    req = wire.verify_request(steps.VerifyRequest("s", 10, relayed), {})
    direct = wire.verify_request(steps.VerifyRequest("s", 10, decoded), {})
    assert req.SerializeToString() == direct.SerializeToString()
    # A window (a pre-draft minus its first token) keeps the matching rows.
    tail = relayed.window(1)
    assert tail.token_ids == relayed.token_ids[1:] and tail.wire_q == relayed.wire_q[1:]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda m: m.token_ids.__setitem__(0, V + 3), "outside the vocabulary"),
        (lambda m: m.q.add(id_gaps=b"\x01", weights=b"\x01"), "positions for"),
        (lambda m: m.q[0].token_ids.append(5), "exactly one of"),
        (lambda m: setattr(m.q[1], "id_gaps", b"\x01" * 5000), "the limit is"),
    ],
)
def test_the_relay_still_refuses_what_lengths_and_ids_show(mutate, needle: str) -> None:
    msg = wire.proposal_to_proto(_model_proposal())
    mutate(msg)
    with pytest.raises(InvalidArgument, match=needle):
        wire.proposal_from_proto(msg, V, relay=True)


def test_a_relayed_q_with_bad_numbers_is_refused_by_the_target_side_check() -> None:
    msg = wire.proposal_to_proto(_model_proposal())
    outside = varint.encode(np.array([V + 5]))  # an id outside the vocabulary
    msg.q[0].CopyFrom(common_pb2.SparseDistribution(id_gaps=outside, weights=b"\x01"))
    relayed = wire.proposal_from_proto(msg, V, relay=True)  # lengths are fine: it passes the relay
    req = wire.verify_request(steps.VerifyRequest("s", 10, relayed), {})
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):  # what the target's servicer runs
        wire.proposal_from_verify(req.verify, V, max_draft_tokens=256, max_q_width=4096)
