"""Translates Draft stream messages into drafter calls; nothing else."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from specd.core.draft.protocol import Drafter, draft_work
from specd.core.draft.suffix import LearningDrafter
from specd.core.draft.trees import propose_trees
from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.rounds.steps import MAX_BRANCH_BUDGET, Branches, DraftResult, DraftWork, TreeProposeRequest
from specd.core.sampling.tree import DraftTree
from specd.serving import trace_names
from specd.serving import tracing as tr
from specd.serving.metrics import DraftMetrics
from specd.serving.round_servicing import BatchedRoundServicer
from specd.serving.tree_wire import draft_tree_to_proto, tree_propose_from_proto
from specd.serving.wire import (
    branch_request_from_proto,
    branches_to_proto,
    params_from_proto,
    proposal_to_proto,
    propose_request_from_proto,
    q_wire_bytes,
    sparse_rows_to_proto,
)
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc


@dataclass(frozen=True)
class TimedTree:
    """A drafted tree with its batch's wall time (the tree calls' shared passes count whole)."""

    tree: DraftTree
    compute_ms: float
    batch_size: int


Work = DraftWork | TreeProposeRequest
Result = DraftResult | TimedTree


class DraftServicer(
    BatchedRoundServicer[draft_pb2.DraftRequest, draft_pb2.DraftResponse, Work, Result],
    draft_pb2_grpc.DraftServicer,
):
    step_op = "propose"
    # A speculation cache's branch calls and tree calls join the propose batches (trees run as one batch).
    extra_step_ops = frozenset({"branches", "tree"})
    span_prefix = trace_names.SPAN_DRAFT_PHASE_PREFIX
    request_type = draft_pb2.DraftRequest
    response_type = draft_pb2.DraftResponse
    responses_type = draft_pb2.DraftResponses
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
        # A model drafter keeps its next branch call's ranking rows ready while nothing is queued.
        self.batcher.idle = getattr(drafter, "idle", None)

    def step_request(self, req: draft_pb2.DraftRequest) -> Work:
        if req.WhichOneof("op") == "tree":  # a tree's nodes are its draft tokens: the same limit
            return tree_propose_from_proto(req, max_budget=self.max_draft_tokens, max_depth=self.max_draft_tokens)
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

    def run_step_batch(self, work: Sequence[Work]) -> list[Result | Exception]:
        """Chain work (proposes, branches) as one batch, tree calls as another; results in request order."""
        out: list[Result | Exception | None] = [None] * len(work)
        chains = [(i, w) for i, w in enumerate(work) if not isinstance(w, TreeProposeRequest)]
        trees = [(i, w) for i, w in enumerate(work) if isinstance(w, TreeProposeRequest)]
        if chains:
            for (i, _), result in zip(chains, draft_work(self.engine, [w for _, w in chains])):
                out[i] = result
        if trees:
            t0 = time.perf_counter()
            try:
                drafted: Sequence[DraftTree | Exception] = propose_trees(self.engine, [w for _, w in trees])
            except Exception as exc:  # noqa: BLE001 - e.g. a drafter that cannot draft trees: each request's error
                drafted = [exc] * len(trees)
            ms = (time.perf_counter() - t0) * 1e3
            for (i, _), tree in zip(trees, drafted):
                out[i] = tree if isinstance(tree, Exception) else TimedTree(tree, ms, len(trees))
        return [r for r in out if r is not None]

    def fill_step(self, resp: draft_pb2.DraftResponse, result: Result) -> PhaseLog:
        if isinstance(result, TimedTree):
            resp.tree.CopyFrom(draft_tree_to_proto(result.tree, result.compute_ms, result.batch_size))
            return PhaseLog(batch_size=result.batch_size)
        if isinstance(result, Branches):  # each branch's q: late_fill
            resp.branches.CopyFrom(branches_to_proto(result, with_q=False))
            return result.phases
        resp.proposal.CopyFrom(proposal_to_proto(result))
        if self.metrics is not None and resp.proposal.q:
            self.metrics.observe_q(q_wire_bytes(resp.proposal), result.q_ms)
        return result.phases

    def late_fill(self, resp: draft_pb2.DraftResponse, result: Result) -> Callable[[], None] | None:
        """A branch call's q rows, encoded by the stream in one pass while the model thread goes on.

        Only branches: their reply is a pre-draft, with the verify still running. A propose's
        reply is what its round waits for, and handing its encoding to the event loop while the
        model thread runs Python of its own measured slower (emulated h100-8b, T = 0.7:
        speccache-2 1.24-1.28x target-only against 1.30-1.31x, three alternated pairs).
        """
        if not isinstance(result, Branches):
            return None
        proposals = [b.proposal for b in result.branches]
        if all(p.q_ids is None and p.wire_q is None for p in proposals):  # greedy, n-gram, suffix: no q
            return None
        messages = [b.proposal for b in resp.branches.branches]

        def fill() -> None:
            for msg, q in zip(messages, sparse_rows_to_proto(proposals)):
                msg.q.extend(q)

        return fill

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
            req.session_id,
            list(o.token_ids),
            params_from_proto(o.sampling),
            o.wire_top_k,
            tenant=o.tenant,
            confidence=not o.without_confidence,
        )

    def observe_step(
        self, req: draft_pb2.DraftRequest, resp: draft_pb2.DraftResponse, batch_size: int
    ) -> dict[str, Any]:
        if req.WhichOneof("op") == "tree":  # counted as one propose of the tree's nodes
            tokens, compute_ms, asked = len(resp.tree.token_ids), resp.tree.compute_ms, req.tree.budget
        elif req.WhichOneof("op") == "branches":  # counted as one propose of all the branches' tokens
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
