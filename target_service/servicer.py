"""Translates Target stream messages into verifier calls; nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc

from specd.core.errors import InvalidArgument
from specd.core.proposal import Proposal
from specd.core.verification import Verifier, VerifyOutcome, VerifyRequest
from specd.serving import tracing as tr
from specd.serving.grpc_errors import session_error
from specd.serving.metrics import TargetMetrics
from specd.serving.round_servicing import BatchedRoundServicer, Handled
from specd.serving.wire import params_from_proto
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class TargetServicer(
    BatchedRoundServicer[target_pb2.TargetRequest, target_pb2.TargetResponse], target_pb2_grpc.TargetServicer
):
    step_op = "verify"
    span_names = {"open": tr.SPAN_TARGET_OPEN, "verify": tr.SPAN_TARGET_VERIFY, "close": tr.SPAN_TARGET_CLOSE}
    phase_span_prefix = tr.SPAN_TARGET_PHASE_PREFIX

    def __init__(
        self,
        verifier: Verifier,
        executor: Executor,
        info: common_pb2.ModelInfo,
        *,
        tracing: tr.Tracing | None = None,
        metrics: TargetMetrics | None = None,
        max_batch: int = 32,
        batch_wait_s: float = 0.0,
    ) -> None:
        super().__init__(
            executor,
            tracing=tracing,
            metrics=metrics,
            max_batch=max_batch,
            batch_wait_s=batch_wait_s,
            active_sessions=verifier.active_sessions,
        )
        self.verifier = verifier
        self.info = info
        if metrics is not None:
            metrics.watch_sessions(verifier.active_sessions, verifier.kv_bytes)

    @staticmethod
    def _response(req: target_pb2.TargetRequest) -> target_pb2.TargetResponse:
        return target_pb2.TargetResponse(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )

    def run_steps(self, requests: Sequence[target_pb2.TargetRequest]) -> list[Handled]:
        """Verify messages of different sessions: one batched verification (model thread)."""
        out: list[Handled | None] = [None] * len(requests)
        work: list[tuple[int, VerifyRequest]] = []
        for i, req in enumerate(requests):
            v = req.verify
            try:
                proposal = Proposal.from_wire(
                    list(v.draft_token_ids),
                    [(list(d.token_ids), list(d.probs)) for d in v.q],
                    self.verifier.vocab_size,
                )
            except Exception as exc:  # noqa: BLE001 - this message's error, in-band
                out[i] = (self._error(req, exc), None)
                continue
            work.append(
                (
                    i,
                    VerifyRequest(
                        req.session_id, req.committed_length, proposal, v.start, list(v.token_ids), v.defer_bonus
                    ),
                )
            )
        results = self.verifier.verify_batch([w for _, w in work]) if work else []
        for (i, _), result in zip(work, results):
            resp = self._response(requests[i])
            if isinstance(result, VerifyOutcome):
                resp.committed_length = result.committed_length
                resp.verdict.accepted = result.accepted
                if result.deferred:
                    resp.verdict.kind = target_pb2.TOKEN_KIND_DEFERRED
                else:
                    resp.verdict.token_id = result.token_id
                    resp.verdict.kind = (
                        target_pb2.TOKEN_KIND_BONUS if result.is_bonus else target_pb2.TOKEN_KIND_RECOVERED
                    )
                resp.verdict.compute_ms = result.compute_ms
                resp.verdict.batch_size = result.phases.batch_size
                resp.verdict.batch_tokens = result.phases.batch_tokens
                out[i] = (resp, result.phases)
            else:
                out[i] = (self._error(requests[i], result), None)
        assert all(h is not None for h in out)
        return out  # type: ignore[return-value]

    def run_other(self, req: target_pb2.TargetRequest) -> target_pb2.TargetResponse:
        """open / close (or a message with no op): per-session errors go back in-band."""
        resp = self._response(req)
        try:
            op = req.WhichOneof("op")
            if op == "open":
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

    def observe_step(
        self, req: target_pb2.TargetRequest, resp: target_pb2.TargetResponse, batch_size: int
    ) -> dict[str, Any]:
        v = resp.verdict
        kind = tr.token_kind(v.kind == target_pb2.TOKEN_KIND_BONUS, v.kind == target_pb2.TOKEN_KIND_DEFERRED)
        drafts = len(req.verify.draft_token_ids)
        if self.metrics is not None:
            self.metrics.observe_verify(drafts, v.accepted, kind, v.compute_ms, batch_size)
        return {
            tr.ATTR_DRAFT_TOKENS: drafts,
            tr.ATTR_ACCEPTED: v.accepted,
            tr.ATTR_TOKEN_KIND: kind,
            tr.ATTR_COMPUTE_MS: v.compute_ms,
            tr.ATTR_BATCH_SIZE: batch_size,
        }

    async def Rounds(
        self, request_iterator: AsyncIterator[target_pb2.TargetRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.TargetResponse]:
        async for response in self.serve(request_iterator, context):
            yield response

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.info
