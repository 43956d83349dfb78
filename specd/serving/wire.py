"""Translation between the v1 protobuf messages and the core's types.

Servicers and the coordinator call these; the core never imports *_pb2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from specd.core.drafting import ProposeRequest
from specd.core.generation import FinishReason
from specd.core.phases import PhaseLog
from specd.core.proposal import Proposal
from specd.core.record import RequestStats
from specd.core.sampling import SamplingParams
from specd.core.verification import VerifyOutcome, VerifyRequest
from specd.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2


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


# ---- the coordinator's round streams (coordinator/peers.py, coordinator/ports.py) ----------

RoundRequest = TypeVar("RoundRequest", draft_pb2.DraftRequest, target_pb2.TargetRequest)


def open_request(
    kind: type[RoundRequest],
    session_id: str,
    token_ids: Sequence[int],
    params: SamplingParams,
    carrier: Mapping[str, str],
) -> RoundRequest:
    """Open (or re-open) a session on a draft or target stream with the committed tokens."""
    req = kind(session_id=session_id, committed_length=len(token_ids), trace_context=carrier)
    req.open.token_ids.extend(token_ids)
    req.open.sampling.CopyFrom(params_to_proto(params))
    return req


def close_request(kind: type[RoundRequest], session_id: str) -> RoundRequest:
    req = kind(session_id=session_id)
    req.close.SetInParent()
    return req


def propose_request(
    session_id: str,
    committed_length: int,
    start: int,
    tail: Sequence[int],
    num_tokens: int,
    carrier: Mapping[str, str],
) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(session_id=session_id, committed_length=committed_length, trace_context=carrier)
    req.propose.start = start
    req.propose.token_ids.extend(tail)
    req.propose.num_tokens = num_tokens
    return req


def verify_request(
    session_id: str, committed_length: int, proposal: Proposal, defer_bonus: bool, carrier: Mapping[str, str]
) -> target_pb2.TargetRequest:
    req = target_pb2.TargetRequest(session_id=session_id, committed_length=committed_length, trace_context=carrier)
    req.verify.start = committed_length  # the target rolls back any verdict the coordinator did not see
    req.verify.draft_token_ids.extend(proposal.token_ids)
    req.verify.q.extend(sparse_to_proto(proposal))
    req.verify.defer_bonus = defer_bonus
    return req


def verdict_from_proto(resp: target_pb2.TargetResponse) -> VerifyOutcome:
    v = resp.verdict
    deferred = v.kind == target_pb2.TOKEN_KIND_DEFERRED
    return VerifyOutcome(
        accepted=v.accepted,
        token_id=-1 if deferred else v.token_id,
        is_bonus=v.kind == target_pb2.TOKEN_KIND_BONUS,
        deferred=deferred,
        committed_length=resp.committed_length,
        compute_ms=v.compute_ms,
        phases=PhaseLog(batch_size=max(1, v.batch_size), batch_tokens=v.batch_tokens),
    )


# ---- the public API's replies (coordinator/servicer.py) ------------------------------------

FINISH_REASONS = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: common_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.CONTEXT_FULL: common_pb2.FINISH_REASON_CONTEXT_FULL,
}


def stats_to_proto(stats: RequestStats) -> coordinator_pb2.GenerateStats:
    r = stats.rounds
    return coordinator_pb2.GenerateStats(
        rounds=r.rounds,
        drafts=r.drafts,
        draft_tokens=r.draft_tokens,
        accepted_tokens=r.accepted_tokens,
        acceptance_length=r.acceptance_length,
        acceptance_rate=r.acceptance_rate,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        time_to_first_token_ms=stats.time_to_first_token_ms,
        tokens_per_s=stats.tokens_per_s,
        seed=stats.seed,
        target_only_rounds=r.target_only_rounds,
        pipeline_hits=r.pipeline_hits,
        accepted_per_position=r.accepted_per_position,
    )
