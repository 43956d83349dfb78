"""Translation between the v1 protobuf messages and the core's types.

Servicers and the coordinator call these; the core never imports *_pb2.
"""

from __future__ import annotations

from collections.abc import Sequence

from specd.core import sparse_q
from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.v1 import common_pb2, draft_pb2


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


def sparse_to_proto(proposal: Proposal) -> list[common_pb2.SparseDistribution]:
    """Per draft position, q as sent: compact when the weights are integers (a model draft's), else plain."""
    if proposal.q_ids is None or proposal.q_probs is None:
        return []
    if sparse_q.is_integral(proposal.q_probs):
        out = []
        for ids, weights in zip(proposal.q_ids, proposal.q_probs):
            gaps, ints = sparse_q.to_compact(ids, weights)
            out.append(common_pb2.SparseDistribution(id_gaps=gaps, weights=ints))
        return out
    return [common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in proposal.to_wire()]


def sparse_from_proto(
    q: Sequence[common_pb2.SparseDistribution], vocab_size: int
) -> list[tuple[list[int], list[float]]]:
    """Per position (ids, probs) from either form (InvalidArgument on a malformed compact one)."""
    out: list[tuple[list[int], list[float]]] = []
    for i, d in enumerate(q):
        if d.id_gaps or d.weights:
            if d.token_ids or d.probs:
                raise InvalidArgument(f"q at draft position {i} mixes the plain and the compact form; send one")
            out.append(sparse_q.from_compact(d.id_gaps, d.weights, vocab_size))
        else:
            out.append((list(d.token_ids), list(d.probs)))
    return out


def q_wire_bytes(msg: draft_pb2.DraftProposal) -> list[int]:
    """Bytes each position's q takes inside the message (its field tag and length included)."""
    return [1 + _varint_bytes(n) + n for n in (d.ByteSize() for d in msg.q)]


def _varint_bytes(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def proposal_to_proto(proposal: Proposal) -> draft_pb2.DraftProposal:
    return draft_pb2.DraftProposal(
        token_ids=proposal.token_ids,
        q=sparse_to_proto(proposal),
        compute_ms=proposal.compute_ms,
        batch_size=proposal.phases.batch_size,
    )


def proposal_from_proto(msg: draft_pb2.DraftProposal, vocab_size: int) -> Proposal:
    """Validated proposal (InvalidArgument on out-of-range IDs or bad probabilities)."""
    proposal = Proposal.from_wire(list(msg.token_ids), sparse_from_proto(msg.q, vocab_size), vocab_size)
    return Proposal(
        proposal.token_ids,
        proposal.q_ids,
        proposal.q_probs,
        msg.compute_ms,
        phases=PhaseLog(batch_size=max(1, msg.batch_size)),
    )
