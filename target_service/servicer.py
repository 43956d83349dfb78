"""Translates Target stream messages into verifier calls; nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from specd import tracing as tr
from specd.errors import InvalidArgument
from specd.grpc_errors import session_error
from specd.proposal import Proposal
from specd.metrics import TargetMetrics
from specd.streams import serve_round_stream
from specd.v1 import common_pb2, session_pb2, target_pb2, target_pb2_grpc
from specd.verification import Verifier
from specd.wire import params_from_proto

log = logging.getLogger(__name__)

_SPANS = {"open": tr.SPAN_TARGET_OPEN, "verify": tr.SPAN_TARGET_VERIFY, "close": tr.SPAN_TARGET_CLOSE}


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, verifier: Verifier, executor: Executor, info: common_pb2.ModelInfo,
                 *, tracing: tr.Tracing | None = None, metrics: TargetMetrics | None = None) -> None:
        self.verifier = verifier
        self.executor = executor
        self.info = info
        self.tracing = tracing or tr.TRACING_OFF
        self.metrics = metrics
        if metrics is not None:
            metrics.watch_sessions(verifier.active_sessions)

    def observed(self, req: target_pb2.TargetRequest) -> target_pb2.TargetResponse:
        """handle() in a span under the round the message belongs to (if it carries one), and counted."""
        op = req.WhichOneof("op") or "none"
        span = None
        if req.trace_context:
            span = self.tracing.start_remote_child(
                _SPANS.get(op, tr.SPAN_TARGET_VERIFY),
                req.trace_context,
                {tr.ATTR_SESSION_ID: req.session_id, tr.ATTR_COMMITTED_LENGTH: req.committed_length},
            )
        resp = self.handle(req)
        if span is None and self.metrics is None:
            return resp
        error = None
        if resp.WhichOneof("result") == "error":
            error = (session_pb2.SessionError.Code.Name(resp.error.code).removeprefix("CODE_").lower(), resp.error.message)
        attributes = None
        if op == "verify" and error is None:
            v = resp.verdict
            kind = tr.token_kind(v.kind == target_pb2.TOKEN_KIND_BONUS)
            drafts = len(req.verify.draft_token_ids)
            attributes = {tr.ATTR_DRAFT_TOKENS: drafts, tr.ATTR_ACCEPTED: v.accepted, tr.ATTR_TOKEN_KIND: kind,
                          tr.ATTR_COMPUTE_MS: v.compute_ms}
            if self.metrics is not None:
                self.metrics.observe_verify(drafts, v.accepted, kind, v.compute_ms)
        tr.end_message_span(span, attributes, error)
        if self.metrics is not None:
            self.metrics.observe_message(op, "ok" if error is None else error[0])
        return resp

    def handle(self, req: target_pb2.TargetRequest) -> target_pb2.TargetResponse:
        """One request, on the model thread; per-session errors go back in-band."""
        resp = target_pb2.TargetResponse(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )
        try:
            op = req.WhichOneof("op")
            if op == "verify":
                v = req.verify
                proposal = Proposal.from_wire(
                    list(v.draft_token_ids),
                    [(list(d.token_ids), list(d.probs)) for d in v.q],
                    self.verifier.vocab_size,
                )
                outcome = self.verifier.verify(
                    req.session_id, req.committed_length, proposal, start=v.start, tail=list(v.token_ids)
                )
                resp.committed_length = outcome.committed_length
                resp.verdict.accepted = outcome.accepted
                resp.verdict.token_id = outcome.token_id
                resp.verdict.kind = (
                    target_pb2.TOKEN_KIND_BONUS if outcome.is_bonus else target_pb2.TOKEN_KIND_RECOVERED
                )
                resp.verdict.compute_ms = outcome.compute_ms
            elif op == "open":
                if len(req.open.token_ids) != req.committed_length:
                    raise InvalidArgument("open: committed_length must equal the number of token_ids")
                if not req.open.sampling.HasField("seed"):
                    raise InvalidArgument("open: sampling.seed must be set (the coordinator picks one)")
                self.verifier.open(req.session_id, list(req.open.token_ids), params_from_proto(req.open.sampling))
                resp.ack.SetInParent()
            elif op == "close":
                self.verifier.close(req.session_id)
                resp.ack.SetInParent()
            else:
                raise InvalidArgument("TargetRequest needs one of open, verify, close")
        except Exception as exc:  # noqa: BLE001 - reported in-band; internals logged by session_error
            resp.error.CopyFrom(session_error(exc))
        return resp

    async def Rounds(
        self, request_iterator: AsyncIterator[target_pb2.TargetRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.TargetResponse]:
        # Headers first, so the coordinator knows the stream is up before any round.
        await context.send_initial_metadata(())
        async for response in serve_round_stream(request_iterator, self.observed, self.executor):
            yield response

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.info
