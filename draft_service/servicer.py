"""Translates Draft stream messages into drafter calls; nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc

from specd.core.drafting import Drafter, ProposeRequest
from specd.core.errors import InvalidArgument
from specd.core.proposal import Proposal
from specd.serving import tracing as tr
from specd.serving.grpc_errors import session_error
from specd.serving.metrics import DraftMetrics
from specd.serving.round_servicing import BatchedRoundServicer, Handled
from specd.serving.wire import params_from_proto, proposal_to_proto
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


class DraftServicer(
    BatchedRoundServicer[draft_pb2.DraftRequest, draft_pb2.DraftResponse], draft_pb2_grpc.DraftServicer
):
    step_op = "propose"
    span_names = {"open": tr.SPAN_DRAFT_OPEN, "propose": tr.SPAN_DRAFT_PROPOSE, "close": tr.SPAN_DRAFT_CLOSE}
    phase_span_prefix = tr.SPAN_DRAFT_PHASE_PREFIX

    def __init__(
        self,
        drafter: Drafter,
        executor: Executor,
        info: common_pb2.ModelInfo,
        max_draft_tokens: int,
        *,
        tracing: tr.Tracing | None = None,
        metrics: DraftMetrics | None = None,
        max_batch: int = 32,
        batch_wait_s: float = 0.0,
    ) -> None:
        super().__init__(
            executor,
            tracing=tracing,
            metrics=metrics,
            max_batch=max_batch,
            batch_wait_s=batch_wait_s,
            active_sessions=drafter.active_sessions,
        )
        self.drafter = drafter
        self.info = info
        self.max_draft_tokens = max_draft_tokens
        if metrics is not None:
            metrics.watch_sessions(drafter.active_sessions, getattr(drafter, "kv_bytes", None))

    @staticmethod
    def _response(req: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        return draft_pb2.DraftResponse(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )

    def run_steps(self, requests: Sequence[draft_pb2.DraftRequest]) -> list[Handled]:
        """Propose messages of different sessions: one batched drafting step (model thread)."""
        out: list[Handled | None] = [None] * len(requests)
        work: list[tuple[int, ProposeRequest]] = []
        for i, req in enumerate(requests):
            p = req.propose
            if not 1 <= p.num_tokens <= self.max_draft_tokens:
                out[i] = (
                    self._error(
                        req, InvalidArgument(f"num_tokens must be in 1..{self.max_draft_tokens} (got {p.num_tokens})")
                    ),
                    None,
                )
                continue
            work.append(
                (i, ProposeRequest(req.session_id, req.committed_length, p.start, list(p.token_ids), p.num_tokens))
            )
        results = self.drafter.propose_batch([w for _, w in work]) if work else []
        for (i, _), result in zip(work, results):
            resp = self._response(requests[i])
            if isinstance(result, Proposal):
                resp.proposal.CopyFrom(proposal_to_proto(result))
                out[i] = (resp, result.phases)
            else:
                out[i] = (self._error(requests[i], result), None)
        assert all(h is not None for h in out)
        return out  # type: ignore[return-value]

    def run_other(self, req: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        """open / close (or a message with no op): per-session errors go back in-band."""
        resp = self._response(req)
        try:
            op = req.WhichOneof("op")
            if op == "open":
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

    def observe_step(
        self, req: draft_pb2.DraftRequest, resp: draft_pb2.DraftResponse, batch_size: int
    ) -> dict[str, Any]:
        tokens, compute_ms = len(resp.proposal.token_ids), resp.proposal.compute_ms
        if self.metrics is not None:
            self.metrics.observe_propose(tokens, compute_ms, batch_size)
        return {
            tr.ATTR_NUM_TOKENS: req.propose.num_tokens,
            tr.ATTR_DRAFT_TOKENS: tokens,
            tr.ATTR_COMPUTE_MS: compute_ms,
            tr.ATTR_BATCH_SIZE: batch_size,
        }

    async def Rounds(
        self, request_iterator: AsyncIterator[draft_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResponse]:
        async for response in self.serve(request_iterator, context):
            yield response

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.info
