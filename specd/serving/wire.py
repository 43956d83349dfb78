"""Translation between the v1 protobuf messages and the core's types.

Servicers and the coordinator call these; the core never imports *_pb2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

from torch import Tensor

from specd.core.errors import InvalidArgument, Unavailable
from specd.core.phases import PhaseLog
from specd.core.rounds import steps
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.record import RequestStats
from specd.core.sampling import compact_q, varint
from specd.core.sampling.proposal import (
    DEFAULT_MAX_DRAFT_TOKENS,
    DEFAULT_MAX_Q_WIDTH,
    Proposal,
    QRow,
    check_row_width,
    check_sizes,
    checked_tokens,
)
from specd.core.sampling.sampler import SamplingParams
from specd.core.transit import Transit
from specd.v1 import common_pb2, coordinator_pb2, draft_pb2, session_pb2, target_pb2


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
    return sparse_rows_to_proto([proposal])[0]


def sparse_rows_to_proto(proposals: Sequence[Proposal]) -> list[list[common_pb2.SparseDistribution]]:
    """sparse_to_proto of each proposal; the compact ones (a branch call's) encoded in one pass over all rows."""
    out: list[list[common_pb2.SparseDistribution]] = [[] for _ in proposals]
    compact: list[int] = []
    qs: list[tuple[Tensor, Tensor]] = []  # the compact ones' (q_ids, q_probs)
    for i, proposal in enumerate(proposals):
        if proposal.wire_q is not None:  # relayed as the draft sent it: the target validates it
            out[i] = list(proposal.wire_q)
        elif proposal.q_ids is None or proposal.q_probs is None:
            continue
        elif proposal.compact_q is not None and len(proposal.compact_q) == len(proposal.q_ids):  # encoded already
            out[i] = [common_pb2.SparseDistribution(id_gaps=gaps, weights=ints) for gaps, ints in proposal.compact_q]
        elif compact_q.is_integral(proposal.q_probs):
            compact.append(i)
            qs.append((proposal.q_ids, proposal.q_probs))
        else:
            out[i] = [common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in proposal.to_wire()]
    for i, rows in zip(compact, compact_q.to_compact_each(qs)):
        out[i] = [common_pb2.SparseDistribution(id_gaps=gaps, weights=ints) for gaps, ints in rows]
    return out


def q_wire_bytes(msg: draft_pb2.DraftProposal) -> list[int]:
    """Bytes each position's q takes inside the message (its field tag and length included)."""
    return [1 + _varint_bytes(n) + n for n in (d.ByteSize() for d in msg.q)]


def _varint_bytes(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def proposal_to_proto(
    proposal: Proposal, q: Sequence[common_pb2.SparseDistribution] | None = None
) -> draft_pb2.DraftProposal:
    """The proposal's message; q: its rows already encoded (sparse_rows_to_proto), or None to encode them."""
    return draft_pb2.DraftProposal(
        token_ids=proposal.token_ids,
        q=sparse_to_proto(proposal) if q is None else q,
        compute_ms=proposal.compute_ms,
        batch_size=proposal.phases.batch_size,
        confidence=proposal.confidence,
    )


def token_ids_from_wire(ids: Sequence[int], limit: int, what: str) -> list[int]:
    """A repeated token-id field as a list, refused before the copy if it is longer than `limit`."""
    if len(ids) > limit:
        raise InvalidArgument(f"{what} has {len(ids)} token ids; the limit is {limit}")
    return list(ids)


def reported_ms(ms: float) -> float:
    """A peer's reported compute time: a non-finite or negative one reads as not reported (0.0).

    Clamped, not refused, like batch_size's max(1, ...): the figure is accounting only (the
    output never depends on it), and 0 is what the records already read as "no sample" (a
    pipelined draft's hidden time), so one peer's inf or NaN cannot reach the round records,
    the metrics or the hybrid drafter's cost estimate. (Auto's choices read the loop's own
    clocks, core/rounds/auto.py.)
    """
    return ms if 0.0 <= ms < math.inf else 0.0  # NaN fails both comparisons


def transit(timing: session_pb2.ServiceTiming, compute_ms: float, round_trip_ms: float, wake_ms: float) -> Transit:
    """A call's hops: the caller's round trip split by the service's own ServiceTiming."""
    return Transit.of_round_trip(
        round_trip_ms, compute_ms, timing.queued_us / 1e3, timing.batch_us / 1e3, timing.reply_us / 1e3, wake_ms
    )


def proposal_from_proto(
    msg: draft_pb2.DraftProposal,
    vocab_size: int,
    *,
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
    max_q_width: int = DEFAULT_MAX_Q_WIDTH,
    transit: Transit | None = None,
    relay: bool = False,
) -> Proposal:
    """Validated proposal (InvalidArgument on out-of-range IDs, bad probabilities or sizes over the limits).

    relay: check only what the lengths and the token ids show, and keep q as it came (wire_q) for
    the target, which validates it (the coordinator never needs q's numbers: decoding and
    re-encoding them was most of its event-loop time at T > 0).
    """
    if relay:
        tokens = _relayed_tokens(msg.token_ids, msg.q, vocab_size, max_draft_tokens, max_q_width)
        return Proposal(
            tokens,
            compute_ms=reported_ms(msg.compute_ms),
            phases=PhaseLog(batch_size=max(1, msg.batch_size)),
            transit=transit,
            wire_q=tuple(msg.q) if len(msg.q) else None,
            confidence=reported_confidence(msg.confidence, len(tokens)),
        )
    proposal = _checked_proposal(msg.token_ids, msg.q, vocab_size, max_draft_tokens, max_q_width)
    return Proposal(
        proposal.token_ids,
        proposal.q_ids,
        proposal.q_probs,
        reported_ms(msg.compute_ms),
        phases=PhaseLog(batch_size=max(1, msg.batch_size)),
        transit=transit,
        confidence=reported_confidence(msg.confidence, len(proposal.token_ids)),
    )


def reported_confidence(values: Sequence[float], k: int) -> tuple[float, ...]:
    """A draft's per-token confidence: one per token in [0, 1] (NaN reads as 0), or none at all.

    Like a compute time it steers efficiency only (where auto cuts a proposal), never the
    output, so a wrong one is clamped or dropped rather than refused."""
    if len(values) != k:
        return ()
    return tuple(min(1.0, v) if v > 0.0 else 0.0 for v in values)  # NaN fails v > 0


def _relayed_tokens(
    token_ids: Sequence[int],
    q: Sequence[common_pb2.SparseDistribution],
    vocab_size: int,
    max_draft_tokens: int,
    max_q_width: int,
) -> list[int]:
    """The draft tokens, checked, and q's shape checked from lengths alone (one row per token or none,
    one form per row, no row wider than the limits); q's numbers are the target's to check."""
    check_sizes(len(token_ids), len(q), max_draft_tokens)
    check_row_forms(q, vocab_size, max_q_width)
    return checked_tokens(token_ids, vocab_size)


def check_row_forms(q: Sequence[common_pb2.SparseDistribution], vocab_size: int, max_q_width: int) -> None:
    """Each q row in exactly one form and no wider than the limits, from its lengths alone
    (InvalidArgument otherwise); what a relay checks of q before passing it on undecoded."""
    for i, d in enumerate(q):
        _is_compact(i, d, min(max_q_width, vocab_size))


def proposal_from_verify(
    msg: target_pb2.Verify, vocab_size: int, *, max_draft_tokens: int, max_q_width: int, decode_q: bool = True
) -> Proposal:
    """The proposal of a Verify message, sizes checked before anything is copied (see Proposal.from_wire).

    decode_q False: a model draft's compact q rows are checked here from their lengths alone and left
    undecoded (Proposal.compact_q) for the verifier, which decodes and checks them while its forward runs."""
    return _checked_proposal(msg.draft_token_ids, msg.q, vocab_size, max_draft_tokens, max_q_width, decode_q)


def _checked_proposal(
    token_ids: Sequence[int],
    q: Sequence[common_pb2.SparseDistribution],
    vocab_size: int,
    max_draft_tokens: int,
    max_q_width: int,
    decode_q: bool = True,
) -> Proposal:
    check_sizes(len(token_ids), len(q), max_draft_tokens)  # before any row is decoded
    compact = compact_rows(q, vocab_size, max_q_width)
    if compact is not None:  # a model draft's: all rows at once
        tokens = checked_tokens(token_ids, vocab_size)
        if not decode_q:
            return Proposal(tokens, compact_q=tuple(compact))
        return Proposal(tokens, *compact_q.dense_from_compact(compact, vocab_size, tokens))
    rows = q_rows(q, vocab_size, max_q_width)
    return Proposal.from_wire(token_ids, rows, vocab_size, max_draft_tokens=max_draft_tokens, max_q_width=max_q_width)


def compact_rows(
    q: Sequence[common_pb2.SparseDistribution], vocab_size: int, max_q_width: int
) -> list[compact_q.CompactRow] | None:
    """q's rows as (id gaps, weights) when there are some and every one is compact (a model draft's),
    to decode all at once (compact_q.dense_from_compact); else None. Sizes are checked first."""
    cap = min(max_q_width, vocab_size)
    if q and all([_is_compact(i, d, cap) for i, d in enumerate(q)]):
        return [(d.id_gaps, d.weights) for d in q]
    return None


def q_rows(q: Sequence[common_pb2.SparseDistribution], vocab_size: int, max_q_width: int) -> list[QRow]:
    """(ids, probs) of the q rows in either form; plain rows are views (no copy). A row in both
    forms or wider than the limits is refused before it is decoded."""
    rows: list[QRow] = []
    for i, d in enumerate(q):
        if _is_compact(i, d, min(max_q_width, vocab_size)):
            rows.append(compact_q.from_compact(d.id_gaps, d.weights, vocab_size))
        else:
            rows.append((d.token_ids, d.probs))
    return rows


def _is_compact(i: int, d: common_pb2.SparseDistribution, cap: int) -> bool:
    """Whether q row i is in the compact form, from lengths alone; InvalidArgument if it holds both
    forms or neither, or more than cap entries."""
    plain = max(len(d.token_ids), len(d.probs))
    compact_bytes = max(len(d.id_gaps), len(d.weights))
    if (plain > 0) == (compact_bytes > 0):
        raise InvalidArgument(f"q at draft position {i} must use exactly one of the plain and the compact form")
    if compact_bytes:  # an entry takes 1 to 5 bytes: refuse what cannot fit before counting the entries
        check_row_width(i, -(-compact_bytes // varint.MAX_BYTES), cap)
        check_row_width(i, max(compact_q.compact_entries(d.id_gaps, d.weights)), cap)
    else:
        check_row_width(i, plain, cap)
    return compact_bytes > 0


# ---- the draft and target services' stream messages (their servicers) ------------------------


def propose_request_from_proto(req: draft_pb2.DraftRequest) -> steps.ProposeRequest:
    p = req.propose
    return steps.ProposeRequest(
        req.session_id, req.committed_length, p.start, list(p.token_ids), p.num_tokens, p.first_guesses_bonus
    )


def branch_request_from_proto(req: draft_pb2.DraftRequest) -> steps.BranchRequest:
    b = req.branches
    return steps.BranchRequest(
        req.session_id,
        req.committed_length,
        b.start,
        list(b.token_ids),
        b.pending,
        b.num_tokens,
        b.budget,
        tuple(float(a) for a in b.acceptance),
    )


def branches_to_proto(result: steps.Branches, *, with_q: bool = True) -> draft_pb2.DraftBranchSet:
    """A branch call's message; with_q=False leaves every q out (the draft service's stream adds them)."""
    qs = sparse_rows_to_proto([b.proposal for b in result.branches]) if with_q else [[] for _ in result.branches]
    return draft_pb2.DraftBranchSet(
        branches=[
            draft_pb2.DraftBranch(accepted=b.accepted, token_id=b.token_id, proposal=proposal_to_proto(b.proposal, q))
            for b, q in zip(result.branches, qs)
        ],
        compute_ms=result.compute_ms,
        batch_size=result.phases.batch_size,
    )


def verify_request_from_proto(
    req: target_pb2.TargetRequest,
    vocab_size: int,
    *,
    max_draft_tokens: int,
    max_q_width: int,
    max_context: int,
    decode_q: bool = True,
) -> steps.VerifyRequest:
    """The core's verify request; sizes are checked before anything is copied (InvalidArgument).
    decode_q: as proposal_from_verify's."""
    v = req.verify
    proposal = proposal_from_verify(
        v, vocab_size, max_draft_tokens=max_draft_tokens, max_q_width=max_q_width, decode_q=decode_q
    )
    tail = token_ids_from_wire(v.token_ids, max_context, "verify.token_ids")
    return steps.VerifyRequest(req.session_id, req.committed_length, proposal, v.start, tail, v.defer_bonus)


def verdict_to_proto(outcome: steps.VerifyOutcome, resp: target_pb2.TargetResponse) -> None:
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


# ---- the coordinator's round streams (coordinator/peers.py) ----------

RoundRequest = TypeVar("RoundRequest", draft_pb2.DraftRequest, target_pb2.TargetRequest)


def open_request(kind: type[RoundRequest], request: steps.OpenRequest, carrier: Mapping[str, str]) -> RoundRequest:
    """Open (or re-open) a session on a draft or target stream with the committed tokens."""
    req = kind(session_id=request.session_id, committed_length=len(request.token_ids), trace_context=carrier)
    req.open.token_ids.extend(request.token_ids)
    req.open.sampling.CopyFrom(params_to_proto(request.params))
    if isinstance(req, draft_pb2.DraftRequest):  # a target learns nothing across sessions, drafts nothing
        if request.tenant:
            req.open.tenant = request.tenant
        req.open.without_confidence = not request.confidence
    return req


def close_request(kind: type[RoundRequest], request: steps.CloseRequest) -> RoundRequest:
    """Close a target session (a target's close carries no tokens)."""
    req = kind(session_id=request.session_id)
    req.close.SetInParent()
    return req


def draft_close_request(request: steps.CloseRequest) -> draft_pb2.DraftRequest:
    """Close a draft session, carrying the committed tokens from `start` on (the draft holds the
    first `start`): a learning drafter (suffix) indexes the whole answer."""
    committed, start = request.committed, request.start
    req = draft_pb2.DraftRequest(session_id=request.session_id, committed_length=len(committed))
    req.close.SetInParent()
    if committed:
        req.close.start = start
        req.close.token_ids.extend(committed[start:])
    return req


def propose_request(request: steps.ProposeRequest, carrier: Mapping[str, str]) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    req.propose.start = request.start
    req.propose.token_ids.extend(request.tail)
    req.propose.num_tokens = request.num_tokens
    req.propose.first_guesses_bonus = request.guess_bonus
    return req


def branches_request(request: steps.BranchRequest, carrier: Mapping[str, str]) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    b = req.branches
    b.start = request.start
    b.token_ids.extend(request.tail)
    b.pending = request.pending
    b.num_tokens = request.num_tokens
    b.budget = request.budget
    b.acceptance.extend(request.acceptance)
    return req


def branches_from_proto(msg: draft_pb2.DraftBranchSet, vocab_size: int, *, relay: bool = False) -> steps.Branches:
    """Validated branches: each proposal as proposal_from_proto checks it, each token within the vocabulary."""
    out = []
    for b in msg.branches:
        if not 0 <= b.token_id < vocab_size:
            raise InvalidArgument(f"branch token id {b.token_id} is outside the vocabulary [0, {vocab_size})")
        out.append(steps.Branch(b.accepted, b.token_id, proposal_from_proto(b.proposal, vocab_size, relay=relay)))
    return steps.Branches(tuple(out), reported_ms(msg.compute_ms), PhaseLog(batch_size=max(1, msg.batch_size)))


def verify_request(request: steps.VerifyRequest, carrier: Mapping[str, str]) -> target_pb2.TargetRequest:
    req = target_pb2.TargetRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    # No start: the committed length, so the target rolls back any verdict the coordinator did not see.
    req.verify.start = request.committed_length if request.start is None else request.start
    req.verify.token_ids.extend(request.tail)
    req.verify.draft_token_ids.extend(request.proposal.token_ids)
    req.verify.q.extend(sparse_to_proto(request.proposal))
    req.verify.defer_bonus = request.defer_bonus
    return req


def stage_request(request: steps.StageRequest, carrier: Mapping[str, str]) -> target_pb2.TargetRequest:
    """Stage the next round's verify: one candidate per verdict a pre-draft assumes (q relayed as drafted)."""
    req = target_pb2.TargetRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    for c in request.candidates:
        staged = req.stage.candidates.add(accepted=c.accepted, deferred=c.deferred, defer_bonus=c.defer_bonus)
        if not c.deferred:
            staged.token_id = c.token_id
        staged.draft_token_ids.extend(c.proposal.token_ids)
        staged.q.extend(sparse_to_proto(c.proposal))
    return req


def staged_outcome_from_proto(
    resp: target_pb2.TargetResponse,
    request: steps.StageRequest,
    round_trip_ms: float,
    wake_ms: float,
    *,
    vocab_size: int | None = None,
) -> steps.StagedOutcome:
    """What the target did with a stage: none ran (an ack), or candidate i's verdict (checked as verdict_from_proto's).

    A candidate index the stage did not have, or a verdict committing another length, is a
    target out of step: Unavailable."""
    if resp.staged_candidate == 0:
        return steps.StagedOutcome.NONE
    index = resp.staged_candidate - 1
    if index >= len(request.candidates) or resp.WhichOneof("result") != "verdict":
        raise Unavailable(f"the target answered a stage of {len(request.candidates)} with candidate {index + 1}")
    outcome = verdict_from_proto(resp, round_trip_ms, wake_ms, vocab_size=vocab_size)
    c = request.candidates[index]
    if outcome.committed_length != c.committed_length(request.committed_length) + outcome.accepted + (
        0 if outcome.deferred else 1
    ):
        raise Unavailable("the target's staged verdict commits another length than its candidate")
    return steps.StagedOutcome(index, outcome)


def proposal_from_answer(
    resp: draft_pb2.DraftResponse, vocab_size: int, round_trip_ms: float, wake_ms: float, *, relay: bool = False
) -> Proposal:
    """A DraftResponse's validated proposal (relay: see proposal_from_proto), with the call's hops."""
    msg = resp.proposal
    hops = transit(resp.timing, reported_ms(msg.compute_ms), round_trip_ms, wake_ms)
    return proposal_from_proto(msg, vocab_size, transit=hops, relay=relay)


def verdict_from_proto(
    resp: target_pb2.TargetResponse,
    round_trip_ms: float | None = None,
    wake_ms: float = 0.0,
    *,
    vocab_size: int | None = None,
) -> steps.VerifyOutcome:
    """The verdict; with the caller's round trip (ms), also the call's hops.

    With vocab_size (the target's), a recovered or bonus token outside the vocabulary is a target
    out of step: Unavailable, as port_sessions._check treats a verdict that cannot belong to the
    round (retried; never InvalidArgument, which the caller reads as a refused proposal). Its
    compute time is reported_ms's.
    """
    v = resp.verdict
    deferred = v.kind == target_pb2.TOKEN_KIND_DEFERRED
    if vocab_size is not None and not deferred and not 0 <= v.token_id < vocab_size:
        raise Unavailable(f"the target sent token id {v.token_id}, outside the vocabulary [0, {vocab_size})")
    compute_ms = reported_ms(v.compute_ms)
    return steps.VerifyOutcome(
        accepted=v.accepted,
        token_id=-1 if deferred else v.token_id,
        is_bonus=v.kind == target_pb2.TOKEN_KIND_BONUS,
        deferred=deferred,
        committed_length=resp.committed_length,
        compute_ms=compute_ms,
        phases=PhaseLog(batch_size=max(1, v.batch_size), batch_tokens=v.batch_tokens),
        transit=None if round_trip_ms is None else transit(resp.timing, compute_ms, round_trip_ms, wake_ms),
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
        pipeline_hits_by_outcome=dict(r.pipeline_hits_by_outcome),
        staged_rounds=r.staged_rounds,
    )
