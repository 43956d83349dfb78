"""Translates Target stream messages into verifier calls; nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.rounds.steps import VerifyOutcome, VerifyRequest
from specd.core.target.verifier import Verifier
from specd.serving import trace_names, trace_spans
from specd.serving.round_servicing import BatchedRoundServicer
from specd.serving.wire import params_from_proto, token_ids_from_wire, verdict_to_proto, verify_request_from_proto
from specd.v1 import target_pb2, target_pb2_grpc


class TargetServicer(
    BatchedRoundServicer[target_pb2.TargetRequest, target_pb2.TargetResponse, VerifyRequest, VerifyOutcome],
    target_pb2_grpc.TargetServicer,
):
    step_op = "verify"
    span_prefix = trace_names.SPAN_TARGET_PHASE_PREFIX
    request_type = target_pb2.TargetRequest
    response_type = target_pb2.TargetResponse
    engine: Verifier  # TargetServicer(verifier, executor, info, *, tracing, metrics, max_batch, batch_wait_s)

    def step_request(self, req: target_pb2.TargetRequest) -> VerifyRequest:
        v = self.engine
        return verify_request_from_proto(
            req,
            v.vocab_size,
            max_draft_tokens=v.max_draft_tokens,
            max_q_width=v.max_q_width,
            max_context=v.runner.max_context,
        )

    def run_step_batch(self, work: Sequence[VerifyRequest]) -> list[VerifyOutcome | Exception]:
        return self.engine.verify_batch(work)

    def fill_step(self, resp: target_pb2.TargetResponse, result: VerifyOutcome) -> PhaseLog:
        verdict_to_proto(result, resp)
        return result.phases

    def open_session(self, req: target_pb2.TargetRequest) -> None:
        if not req.open.sampling.HasField("seed"):
            raise InvalidArgument("open: sampling.seed must be set (the coordinator picks one)")
        ids = token_ids_from_wire(req.open.token_ids, self.engine.runner.max_context, "open.token_ids")
        self.engine.open(req.session_id, ids, params_from_proto(req.open.sampling))

    def observe_step(
        self, req: target_pb2.TargetRequest, resp: target_pb2.TargetResponse, batch_size: int
    ) -> dict[str, Any]:
        v = resp.verdict
        kind = trace_spans.token_kind(v.kind == target_pb2.TOKEN_KIND_BONUS, v.kind == target_pb2.TOKEN_KIND_DEFERRED)
        drafts = len(req.verify.draft_token_ids)
        if self.metrics is not None:
            self.metrics.observe_verify(drafts, v.accepted, kind, v.compute_ms, batch_size)
        return {
            trace_names.ATTR_DRAFT_TOKENS: drafts,
            trace_names.ATTR_ACCEPTED: v.accepted,
            trace_names.ATTR_TOKEN_KIND: kind,
            trace_names.ATTR_COMPUTE_MS: v.compute_ms,
            trace_names.ATTR_BATCH_SIZE: batch_size,
        }
