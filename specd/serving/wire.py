"""Translation between the v1 protobuf messages and the core's types.

Servicers and the coordinator call these; the core never imports *_pb2.
"""

from __future__ import annotations

from collections.abc import Sequence

from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.proposal import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_Q_WIDTH, Proposal
from specd.core.sampling import SamplingParams
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


def token_ids_from_wire(ids: Sequence[int], limit: int, what: str) -> list[int]:
    """A repeated token-id field as a list, refused before the copy if it is longer than `limit`."""
    if len(ids) > limit:
        raise InvalidArgument(f"{what} has {len(ids)} token ids; the limit is {limit}")
    return list(ids)


def proposal_from_proto(
    msg: draft_pb2.DraftProposal,
    vocab_size: int,
    *,
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
    max_q_width: int = DEFAULT_MAX_Q_WIDTH,
) -> Proposal:
    """Validated proposal (InvalidArgument on out-of-range IDs, bad probabilities or sizes over the limits)."""
    proposal = Proposal.from_wire(
        msg.token_ids,
        _q_rows(msg.q, len(msg.token_ids)),
        vocab_size,
        max_draft_tokens=max_draft_tokens,
        max_q_width=max_q_width,
    )
    return Proposal(
        proposal.token_ids,
        proposal.q_ids,
        proposal.q_probs,
        msg.compute_ms,
        phases=PhaseLog(batch_size=max(1, msg.batch_size)),
    )


def proposal_from_verify(
    msg: target_pb2.Verify, vocab_size: int, *, max_draft_tokens: int, max_q_width: int
) -> Proposal:
    """The proposal of a Verify message, sizes checked before anything is copied (see Proposal.from_wire)."""
    return Proposal.from_wire(
        msg.draft_token_ids,
        _q_rows(msg.q, len(msg.draft_token_ids)),
        vocab_size,
        max_draft_tokens=max_draft_tokens,
        max_q_width=max_q_width,
    )


def _q_rows(q: Sequence[common_pb2.SparseDistribution], k: int) -> list[tuple[Sequence[int], Sequence[float]]]:
    """(ids, probs) views of the q rows, no copy; refused first if there are more rows than tokens."""
    if len(q) > k:
        raise InvalidArgument(f"q has {len(q)} positions for {k} draft tokens; send one per token or none")
    return [(d.token_ids, d.probs) for d in q]


def sparse_to_proto(proposal: Proposal) -> list[common_pb2.SparseDistribution]:
    return [common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in proposal.to_wire()]
