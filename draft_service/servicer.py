"""Translates Draft stream messages into drafter calls; nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from specd import tracing as tr
from specd.drafting import Drafter
from specd.errors import InvalidArgument
from specd.grpc_errors import session_error
from specd.metrics import DraftMetrics
from specd.streams import serve_round_stream
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, session_pb2
from specd.wire import params_from_proto, proposal_to_proto

log = logging.getLogger(__name__)

_SPANS = {"open": tr.SPAN_DRAFT_OPEN, "propose": tr.SPAN_DRAFT_PROPOSE, "close": tr.SPAN_DRAFT_CLOSE}


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, executor: Executor, info: common_pb2.ModelInfo, max_draft_tokens: int,
                 *, tracing: tr.Tracing | None = None, metrics: DraftMetrics | None = None) -> None:
        self.drafter = drafter
        self.executor = executor
        self.info = info
        self.max_draft_tokens = max_draft_tokens
        self.tracing = tracing or tr.TRACING_OFF
        self.metrics = metrics
        if metrics is not None:
            metrics.watch_sessions(drafter.active_sessions)

    def observed(self, req: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        """handle() in a span under the round the message belongs to (if it carries one), and counted."""
        op = req.WhichOneof("op") or "none"
        span = None
        if req.trace_context:
            span = self.tracing.start_remote_child(
                _SPANS.get(op, tr.SPAN_DRAFT_PROPOSE),
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
        if op == "propose" and error is None:
            tokens, compute_ms = len(resp.proposal.token_ids), resp.proposal.compute_ms
            attributes = {tr.ATTR_NUM_TOKENS: req.propose.num_tokens, tr.ATTR_DRAFT_TOKENS: tokens,
                          tr.ATTR_COMPUTE_MS: compute_ms}
            if self.metrics is not None:
                self.metrics.observe_propose(tokens, compute_ms)
        tr.end_message_span(span, attributes, error)
        if self.metrics is not None:
            self.metrics.observe_message(op, "ok" if error is None else error[0])
        return resp

    def handle(self, req: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        """One request, on the model thread; per-session errors go back in-band."""
        resp = draft_pb2.DraftResponse(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )
        try:
            op = req.WhichOneof("op")
            if op == "propose":
                p = req.propose
                if not 1 <= p.num_tokens <= self.max_draft_tokens:
                    raise InvalidArgument(f"num_tokens must be in 1..{self.max_draft_tokens} (got {p.num_tokens})")
                proposal = self.drafter.propose(
                    req.session_id, req.committed_length, p.start, list(p.token_ids), p.num_tokens
                )
                resp.proposal.CopyFrom(proposal_to_proto(proposal))
            elif op == "open":
                if len(req.open.token_ids) != req.committed_length:
                    raise InvalidArgument("open: committed_length must equal the number of token_ids")
                self.drafter.open(
                    req.session_id, list(req.open.token_ids), params_from_proto(req.open.sampling), req.open.wire_top_k
                )
                resp.ack.SetInParent()
            elif op == "close":
                self.drafter.close(req.session_id)
                resp.ack.SetInParent()
            else:
                raise InvalidArgument("DraftRequest needs one of open, propose, close")
        except Exception as exc:  # noqa: BLE001 - reported in-band; internals logged by session_error
            resp.error.CopyFrom(session_error(exc))
        return resp

    async def Rounds(
        self, request_iterator: AsyncIterator[draft_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResponse]:
        # Headers first, so the coordinator knows the stream is up before any round.
        await context.send_initial_metadata(())
        async for response in serve_round_stream(request_iterator, self.observed, self.executor):
            yield response

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.info
