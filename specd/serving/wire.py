"""Translation between the v1 protobuf messages and the core's types.

Servicers and the coordinator call these; the core never imports *_pb2.
"""

from __future__ import annotations

from specd.core.drafting import ProposeRequest
from specd.core.phases import PhaseLog
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.core.verification import VerifyOutcome, VerifyRequest
from specd.v1 import common_pb2, draft_pb2, target_pb2


def params_from_proto(msg: common_pb2.SamplingParams, *, seed: int | None = None) -> SamplingParams:
    """Core sampling settings from the wire (unset temperature/top_p mean 1.0)."""
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        seed=seed if seed is not None else (msg.seed if msg.HasField("seed") else 0),
    )


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=params.seed,
    )


def proposal_to_proto(proposal: Proposal) -> draft_pb2.DraftProposal:
    msg = draft_pb2.DraftProposal(
        token_ids=proposal.token_ids, compute_ms=proposal.compute_ms, batch_size=proposal.phases.batch_size
    )
    for ids, probs in proposal.to_wire():
        msg.q.add(token_ids=ids, probs=probs)
    return msg


def proposal_from_proto(msg: draft_pb2.DraftProposal, vocab_size: int) -> Proposal:
    """Validated proposal (InvalidArgument on out-of-range IDs or bad probabilities)."""
    q = [(list(d.token_ids), list(d.probs)) for d in msg.q]
    proposal = Proposal.from_wire(list(msg.token_ids), q, vocab_size)
    return Proposal(
        proposal.token_ids,
        proposal.q_ids,
        proposal.q_probs,
        msg.compute_ms,
        phases=PhaseLog(batch_size=max(1, msg.batch_size)),
    )


# ---- the draft and target services' stream messages (their servicers) ------------------------


def propose_request_from_proto(req: draft_pb2.DraftRequest) -> ProposeRequest:
    p = req.propose
    return ProposeRequest(req.session_id, req.committed_length, p.start, list(p.token_ids), p.num_tokens)


def verify_request_from_proto(req: target_pb2.TargetRequest, vocab_size: int) -> VerifyRequest:
    """The core's verify request (InvalidArgument on out-of-range IDs or bad probabilities)."""
    v = req.verify
    proposal = Proposal.from_wire(
        list(v.draft_token_ids), [(list(d.token_ids), list(d.probs)) for d in v.q], vocab_size
    )
    return VerifyRequest(req.session_id, req.committed_length, proposal, v.start, list(v.token_ids), v.defer_bonus)


def verdict_to_proto(outcome: VerifyOutcome, resp: target_pb2.TargetResponse) -> None:
    """Fill a TargetResponse with a verdict (and the committed length after it)."""
    resp.committed_length = outcome.committed_length
    v = resp.verdict
    v.accepted = outcome.accepted
    if outcome.deferred:
        v.kind = target_pb2.TOKEN_KIND_DEFERRED
    else:
        v.token_id = outcome.token_id
        v.kind = target_pb2.TOKEN_KIND_BONUS if outcome.is_bonus else target_pb2.TOKEN_KIND_RECOVERED
    v.compute_ms = outcome.compute_ms
    v.batch_size = outcome.phases.batch_size
    v.batch_tokens = outcome.phases.batch_tokens


def sparse_to_proto(proposal: Proposal) -> list[common_pb2.SparseDistribution]:
    return [common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in proposal.to_wire()]
