"""Translates Draft stream messages into drafter calls; nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from specd.core.draft.protocol import Drafter, draft_work
from specd.core.draft.suffix import LearningDrafter
from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.rounds.steps import MAX_BRANCH_BUDGET, Branches, DraftResult, DraftWork
from specd.serving import trace_names
from specd.serving import tracing as tr
from specd.serving.metrics import DraftMetrics
from specd.serving.round_servicing import BatchedRoundServicer
from specd.serving.wire import (
    branch_request_from_proto,
    branches_to_proto,
    params_from_proto,
    proposal_to_proto,
    propose_request_from_proto,
    q_wire_bytes,
)
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(
    BatchedRoundServicer[draft_pb2.DraftRequest, draft_pb2.DraftResponse, DraftWork, DraftResult],
    draft_pb2_grpc.DraftServicer,
):
    step_op = "propose"
    extra_step_ops = frozenset({"branches"})  # a speculation cache's branch calls join the propose batches
    span_prefix = trace_names.SPAN_DRAFT_PHASE_PREFIX
    request_type = draft_pb2.DraftRequest
    response_type = draft_pb2.DraftResponse
    engine: Drafter

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
            drafter, executor, info, tracing=tracing, metrics=metrics, max_batch=max_batch, batch_wait_s=batch_wait_s
        )
        self.max_draft_tokens = max_draft_tokens

    def step_request(self, req: draft_pb2.DraftRequest) -> DraftWork:
        if req.WhichOneof("op") == "branches":
            b = req.branches
            if not 1 <= b.num_tokens <= self.max_draft_tokens:
                raise InvalidArgument(f"num_tokens must be in 1..{self.max_draft_tokens} (got {b.num_tokens})")
            if not 1 <= b.budget <= MAX_BRANCH_BUDGET:
                raise InvalidArgument(f"budget must be in 1..{MAX_BRANCH_BUDGET} branches (got {b.budget})")
            return branch_request_from_proto(req)
        n = req.propose.num_tokens
        if not 1 <= n <= self.max_draft_tokens:
            raise InvalidArgument(f"num_tokens must be in 1..{self.max_draft_tokens} (got {n})")
        return propose_request_from_proto(req)

    def run_step_batch(self, work: Sequence[DraftWork]) -> list[DraftResult | Exception]:
        return draft_work(self.engine, work)

    def fill_step(self, resp: draft_pb2.DraftResponse, result: DraftResult) -> PhaseLog:
        if isinstance(result, Branches):
            resp.branches.CopyFrom(branches_to_proto(result))
            return result.phases
        resp.proposal.CopyFrom(proposal_to_proto(result))
        if self.metrics is not None and resp.proposal.q:
            self.metrics.observe_q(q_wire_bytes(resp.proposal), result.q_ms)
        return result.phases

    def close_session(self, req: draft_pb2.DraftRequest) -> None:
        # A learning drafter (suffix) indexes the session's answer: the close carries the
        # committed tokens it has not seen (start + token_ids).
        if isinstance(self.engine, LearningDrafter) and req.committed_length:
            c = req.close
            self.engine.finish(req.session_id, req.committed_length, c.start, list(c.token_ids))
        self.engine.close(req.session_id)

    def open_session(self, req: draft_pb2.DraftRequest) -> None:
        o = req.open
        self.engine.open(
            req.session_id, list(o.token_ids), params_from_proto(o.sampling), o.wire_top_k, tenant=o.tenant
        )

    def observe_step(
        self, req: draft_pb2.DraftRequest, resp: draft_pb2.DraftResponse, batch_size: int
    ) -> dict[str, Any]:
        if req.WhichOneof("op") == "branches":  # counted as one propose of all the branches' tokens
            branches = resp.branches.branches
            tokens, compute_ms = sum(len(b.proposal.token_ids) for b in branches), resp.branches.compute_ms
            asked = req.branches.num_tokens
        else:
            tokens, compute_ms, asked = len(resp.proposal.token_ids), resp.proposal.compute_ms, req.propose.num_tokens
        if self.metrics is not None:
            self.metrics.observe_propose(tokens, compute_ms, batch_size)
        return {
            trace_names.ATTR_NUM_TOKENS: asked,
            trace_names.ATTR_DRAFT_TOKENS: tokens,
            trace_names.ATTR_COMPUTE_MS: compute_ms,
            trace_names.ATTR_BATCH_SIZE: batch_size,
        }
