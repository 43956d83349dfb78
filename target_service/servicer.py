"""Translates Target stream messages into verifier calls; nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.rounds.steps import TreeVerifyOutcome, TreeVerifyRequest, VerifyOutcome, VerifyRequest
from specd.core.target.verifier import Verifier
from specd.serving import trace_names, trace_spans
from specd.serving.round_servicing import BatchedRoundServicer
from specd.serving.streams import Stamped
from specd.serving.tree_wire import tree_verdict_to_proto, verify_tree_from_proto
from specd.serving.wire import params_from_proto, token_ids_from_wire, verdict_to_proto, verify_request_from_proto
from specd.v1 import target_pb2, target_pb2_grpc
from target_service.staging import StagedVerifies

Work = VerifyRequest | TreeVerifyRequest
Outcome = VerifyOutcome | TreeVerifyOutcome


class TargetServicer(
    BatchedRoundServicer[target_pb2.TargetRequest, target_pb2.TargetResponse, Work, Outcome],
    target_pb2_grpc.TargetServicer,
):
    step_op = "verify"
    extra_step_ops = frozenset({"verify_tree"})  # tree verifies join the batch; they run as one tree pass
    span_prefix = trace_names.SPAN_TARGET_PHASE_PREFIX
    request_type = target_pb2.TargetRequest
    response_type = target_pb2.TargetResponse
    responses_type = target_pb2.TargetResponses
    engine: Verifier  # TargetServicer(verifier, executor, info, *, tracing, metrics, max_batch, batch_wait_s)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staging = StagedVerifies(self._resubmit, self._answer_now, self._none_staged)

    # ---- staged verifies (target_service/staging.py), on the model thread ------------------

    def hold(self, items: Sequence[Stamped[target_pb2.TargetRequest]]) -> set[int]:
        return self.staging.hold(items)

    def after_batch(
        self, items: Sequence[Stamped[target_pb2.TargetRequest]], responses: Sequence[target_pb2.TargetResponse]
    ) -> None:
        self.staging.after_batch(items, responses)

    def _resubmit(self, item: Stamped[target_pb2.TargetRequest]) -> None:
        assert item.deliver is not None, "a stream's message carries its stream's Deliver"
        self.batcher.submit([item], item.deliver)

    def _answer_now(self, item: Stamped[target_pb2.TargetRequest], resp: target_pb2.TargetResponse) -> None:
        assert item.deliver is not None, "a stream's message carries its stream's Deliver"
        if self.metrics is not None:
            self.metrics.observe_message("stage", "ok")
        item.deliver([(item, resp)])

    def _none_staged(self, req: target_pb2.TargetRequest) -> target_pb2.TargetResponse:
        resp = self._response(req)
        resp.ack.SetInParent()  # staged_candidate 0: none of its candidates ran
        return resp

    def step_request(self, req: target_pb2.TargetRequest) -> Work:
        v = self.engine
        if req.WhichOneof("op") == "verify_tree":  # a tree's nodes are its draft tokens: the same limit
            return verify_tree_from_proto(
                req,
                v.vocab_size,
                max_nodes=v.max_draft_tokens,
                max_q_width=v.max_q_width,
                max_context=v.runner.max_context,
            )
        return verify_request_from_proto(
            req,
            v.vocab_size,
            max_draft_tokens=v.max_draft_tokens,
            max_q_width=v.max_q_width,
            max_context=v.runner.max_context,
            decode_q=False,  # the verifier decodes a model draft's q rows while its forward runs
        )

    def run_step_batch(self, work: Sequence[Work]) -> list[Outcome | Exception]:
        """Chain verifies as one batch, tree verifies as one tree pass; results in request order."""
        out: list[Outcome | Exception | None] = [None] * len(work)
        chains = [(i, w) for i, w in enumerate(work) if isinstance(w, VerifyRequest)]
        trees = [(i, w) for i, w in enumerate(work) if isinstance(w, TreeVerifyRequest)]
        if chains:
            # the batch before's spans and metrics are recorded while this batch's pass runs
            for (i, _), r in zip(chains, self.engine.verify_batch([w for _, w in chains], beside=self.record_answered)):
                out[i] = r
        if trees:
            for (i, _), t in zip(trees, self.engine.verify_tree_batch([w for _, w in trees])):
                out[i] = t
        return [r for r in out if r is not None]

    def fill_step(self, resp: target_pb2.TargetResponse, result: Outcome) -> PhaseLog:
        if isinstance(result, TreeVerifyOutcome):
            tree_verdict_to_proto(result, resp)
        else:
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
        if req.WhichOneof("op") == "verify_tree":  # counted as a verify of its nodes, the path accepted
            t = resp.tree_verdict
            kind_code, accepted, compute_ms = t.kind, len(t.path), t.compute_ms
            drafts = len(req.verify_tree.draft_token_ids)
        else:
            v = resp.verdict
            kind_code, accepted, compute_ms = v.kind, v.accepted, v.compute_ms
            drafts = len(req.verify.draft_token_ids)
        kind = trace_spans.token_kind(
            kind_code == target_pb2.TOKEN_KIND_BONUS, kind_code == target_pb2.TOKEN_KIND_DEFERRED
        )
        if self.metrics is not None:
            self.metrics.observe_verify(drafts, accepted, kind, compute_ms, batch_size)
        return {
            trace_names.ATTR_DRAFT_TOKENS: drafts,
            trace_names.ATTR_ACCEPTED: accepted,
            trace_names.ATTR_TOKEN_KIND: kind,
            trace_names.ATTR_COMPUTE_MS: compute_ms,
            trace_names.ATTR_BATCH_SIZE: batch_size,
        }
