"""The numbers a draft or target reports: a compute time that is inf, NaN or negative reads as not
reported, so it never reaches the records and the bench's cost figures (auto reads the loop's own
clocks, not these); a per-token confidence outside [0, 1] is clamped, one of the wrong length
dropped (it steers where auto cuts, never the output); a verdict's token must be in the vocabulary."""

from __future__ import annotations

import math

import pytest

from specd.core.errors import Unavailable
from specd.core.sampling.proposal import Proposal
from specd.serving import wire
from specd.v1 import draft_pb2, target_pb2

V = 1000
BAD_MS = [math.inf, -math.inf, math.nan, -1.0]


def _draft_answer(compute_ms: float) -> draft_pb2.DraftResponse:
    resp = draft_pb2.DraftResponse()
    resp.proposal.CopyFrom(wire.proposal_to_proto(Proposal([1, 2, 3])))
    resp.proposal.compute_ms = compute_ms
    return resp


def _verdict(compute_ms: float = 4.0, token_id: int = 7, kind: int = target_pb2.TOKEN_KIND_RECOVERED):
    resp = target_pb2.TargetResponse(committed_length=12)
    v = resp.verdict
    v.accepted, v.token_id, v.kind, v.compute_ms, v.batch_size, v.batch_tokens = 1, token_id, kind, compute_ms, 1, 4
    return resp


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("bad", BAD_MS)
def test_a_proposals_bad_compute_time_reads_as_not_reported(bad: float, relay: bool) -> None:
    proposal = wire.proposal_from_answer(_draft_answer(bad), V, round_trip_ms=5.0, wake_ms=0.1, relay=relay)
    assert proposal.compute_ms == 0.0 and proposal.token_ids == [1, 2, 3]
    assert proposal.transit is not None and all(math.isfinite(ms) for _, ms in proposal.transit.hops())
    good = wire.proposal_from_answer(_draft_answer(2.5), V, round_trip_ms=5.0, wake_ms=0.1, relay=relay)
    assert good.compute_ms == 2.5  # a real figure passes as it came


@pytest.mark.parametrize("relay", [True, False])
def test_a_proposals_confidence_crosses_the_wire_clamped_or_not_at_all(relay: bool) -> None:
    def sent(confidence: tuple[float, ...]) -> tuple[float, ...]:
        resp = draft_pb2.DraftResponse()
        resp.proposal.CopyFrom(wire.proposal_to_proto(Proposal([1, 2, 3], confidence=confidence)))
        return wire.proposal_from_answer(resp, V, round_trip_ms=1.0, wake_ms=0.0, relay=relay).confidence

    assert sent((0.75, 0.5, 0.25)) == (0.75, 0.5, 0.25)  # float32 holds these exactly
    assert sent((1.5, -0.2, math.nan)) == (1.0, 0.0, 0.0)
    assert sent((0.9, 0.5)) == () and sent(()) == ()  # not one per token: as if none was sent


@pytest.mark.parametrize("bad", BAD_MS)
def test_branches_bad_compute_times_read_as_not_reported(bad: float) -> None:
    msg = draft_pb2.DraftBranchSet(compute_ms=bad, batch_size=1)
    b = msg.branches.add(accepted=1, token_id=5)
    b.proposal.CopyFrom(wire.proposal_to_proto(Proposal([6, 7])))
    b.proposal.compute_ms = bad
    branches = wire.branches_from_proto(msg, V, relay=True)
    assert branches.compute_ms == 0.0 and branches.branches[0].proposal.compute_ms == 0.0


@pytest.mark.parametrize("bad", BAD_MS)
def test_a_verdicts_bad_compute_time_reads_as_not_reported(bad: float) -> None:
    outcome = wire.verdict_from_proto(_verdict(bad), round_trip_ms=6.0, wake_ms=0.1, vocab_size=V)
    assert outcome.compute_ms == 0.0 and (outcome.accepted, outcome.token_id) == (1, 7)
    assert outcome.transit is not None and all(math.isfinite(ms) for _, ms in outcome.transit.hops())


@pytest.mark.parametrize("token_id", [V, V + 1, 2**32 - 1])
def test_a_verdict_token_outside_the_vocabulary_is_a_target_out_of_step(token_id: int) -> None:
    with pytest.raises(Unavailable, match="outside the vocabulary"):
        wire.verdict_from_proto(_verdict(token_id=token_id), 6.0, vocab_size=V)
    with pytest.raises(Unavailable):
        wire.verdict_from_proto(_verdict(token_id=token_id, kind=target_pb2.TOKEN_KIND_BONUS), 6.0, vocab_size=V)


def test_a_verdict_token_inside_the_vocabulary_and_a_deferred_one_pass() -> None:
    assert wire.verdict_from_proto(_verdict(token_id=V - 1), vocab_size=V).token_id == V - 1
    deferred = _verdict(token_id=V + 5, kind=target_pb2.TOKEN_KIND_DEFERRED)  # no token this round: not looked at
    assert wire.verdict_from_proto(deferred, vocab_size=V).token_id == -1
