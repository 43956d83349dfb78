"""Translation of tree speculation's messages (docs/trees.md) between the v1 protos and the core.

The draft's DraftTreePropose -> steps.TreeProposeRequest, its DraftTree <->
core DraftTree, the target's VerifyTree -> steps.TreeVerifyRequest and its
TreeVerdict <-> steps.TreeVerifyOutcome. A tree's q rows use the chain's
SparseDistribution encoding (compact when the weights are integers, as a
model draft's are). Sizes are checked from the lists' lengths and the parent
indices before any row is decoded or any tensor allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from specd.core.errors import InvalidArgument, Unavailable
from specd.core.phases import PhaseLog
from specd.core.rounds import steps
from specd.core.sampling import compact_q
from specd.core.sampling.proposal import DEFAULT_MAX_Q_WIDTH
from specd.core.sampling.tree import DEFAULT_MAX_TREE_DEPTH, DEFAULT_MAX_TREE_NODES, DraftTree
from specd.serving.wire import check_row_forms, compact_rows, q_rows, reported_ms, token_ids_from_wire
from specd.v1 import common_pb2, draft_pb2, target_pb2


def tree_q_to_proto(tree: DraftTree) -> list[common_pb2.SparseDistribution]:
    """Per node, its q as sent (zero-weight padding slots dropped); none for a one-hot tree."""
    if tree.wire_q is not None:  # relayed as the draft sent it: the target validates it
        return list(tree.wire_q)
    if tree.q_ids is None or tree.q_probs is None:
        return []
    out = []
    if compact_q.is_integral(tree.q_probs):
        rows = compact_q.to_compact(tree.q_ids, tree.q_probs)
        return [common_pb2.SparseDistribution(id_gaps=gaps, weights=ints) for gaps, ints in rows]
    for ids, probs in zip(tree.q_ids, tree.q_probs):
        keep = probs > 0  # [W] the row's support; padding is (id 0, 0)
        out.append(common_pb2.SparseDistribution(token_ids=ids[keep].tolist(), probs=probs[keep].tolist()))
    return out


def tree_from_wire(
    token_ids: Sequence[int],
    parents: Sequence[int],
    q: Sequence[common_pb2.SparseDistribution],
    vocab_size: int,
    *,
    max_nodes: int = DEFAULT_MAX_TREE_NODES,
    max_depth: int = DEFAULT_MAX_TREE_DEPTH,
    max_q_width: int = DEFAULT_MAX_Q_WIDTH,
) -> DraftTree:
    """A validated DraftTree (InvalidArgument naming the node and the limit otherwise).

    Order: node and row counts, then parents and depth (DraftTree.from_wire without q: nothing
    allocated), then each q row's width before it is decoded, then the whole tree with its q."""
    n = len(token_ids)
    if n > max_nodes:
        raise InvalidArgument(f"a draft tree of {n} nodes; this service verifies at most {max_nodes}")
    if len(q) not in (0, n):
        raise InvalidArgument(f"q has {len(q)} rows for {n} tree nodes; send one per node or none")
    limits = {"max_nodes": max_nodes, "max_depth": max_depth, "max_q_width": max_q_width}
    structure = DraftTree.from_wire(token_ids, list(parents), (), vocab_size, **limits)
    if not q:
        return structure
    compact = compact_rows(q, vocab_size, max_q_width)
    if compact is not None:  # a model draft's: every row decoded and checked at once
        q_ids, q_probs = compact_q.dense_from_compact(compact, vocab_size, structure.token_ids)
        return dataclasses.replace(structure, q_ids=q_ids, q_probs=q_probs)
    rows = q_rows(q, vocab_size, max_q_width)
    return DraftTree.from_wire(structure.token_ids, structure.parents, rows, vocab_size, **limits)


# ---- the draft's tree call ------------------------------------------------------------------


def tree_propose_request(request: steps.TreeProposeRequest, carrier: Mapping[str, str]) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    t = req.tree
    t.start = request.start
    t.token_ids.extend(request.tail)
    t.budget = request.budget
    t.depth = request.depth
    return req


def tree_propose_from_proto(
    req: draft_pb2.DraftRequest, *, max_budget: int, max_depth: int
) -> steps.TreeProposeRequest:
    """The core's tree request, or InvalidArgument when budget or depth is outside the service's limits."""
    t = req.tree
    if not 1 <= t.budget <= max_budget:
        raise InvalidArgument(f"tree budget must be in 1..{max_budget} nodes (got {t.budget})")
    if not 1 <= t.depth <= max_depth:
        raise InvalidArgument(f"tree depth must be in 1..{max_depth} levels (got {t.depth})")
    return steps.TreeProposeRequest(req.session_id, req.committed_length, t.start, list(t.token_ids), t.budget, t.depth)


def draft_tree_to_proto(tree: DraftTree, compute_ms: float = 0.0, batch_size: int = 1) -> draft_pb2.DraftTree:
    return draft_pb2.DraftTree(
        token_ids=tree.token_ids,
        parents=tree.parents,
        q=tree_q_to_proto(tree),
        compute_ms=compute_ms,
        batch_size=batch_size,
    )


def draft_tree_from_proto(msg: draft_pb2.DraftTree, vocab_size: int, *, budget: int, depth: int) -> DraftTree:
    """A draft's tree for relaying: node count, parents, depth and token ids checked against the
    target's vocabulary and the request's budget and depth, each q row's form and width from its
    lengths; q itself goes on to the target undecoded (`DraftTree.wire_q`), which validates it."""
    n = len(msg.token_ids)
    if n > budget:
        raise InvalidArgument(f"a draft tree of {n} nodes; this request allows at most {budget}")
    if len(msg.q) not in (0, n):
        raise InvalidArgument(f"q has {len(msg.q)} rows for {n} tree nodes; send one per node or none")
    check_row_forms(msg.q, vocab_size, DEFAULT_MAX_Q_WIDTH)
    structure = DraftTree.from_wire(msg.token_ids, list(msg.parents), (), vocab_size, max_nodes=budget, max_depth=depth)
    return dataclasses.replace(structure, wire_q=tuple(msg.q) if len(msg.q) else None)


# ---- the target's tree verify ------------------------------------------------------------------


def verify_tree_request(request: steps.TreeVerifyRequest, carrier: Mapping[str, str]) -> target_pb2.TargetRequest:
    req = target_pb2.TargetRequest(
        session_id=request.session_id, committed_length=request.committed_length, trace_context=carrier
    )
    v = req.verify_tree
    v.start = request.committed_length if request.start is None else request.start  # as verify_request's
    v.token_ids.extend(request.tail)
    v.draft_token_ids.extend(request.tree.token_ids)
    v.parents.extend(request.tree.parents)
    v.q.extend(tree_q_to_proto(request.tree))
    return req


def verify_tree_from_proto(
    req: target_pb2.TargetRequest,
    vocab_size: int,
    *,
    max_nodes: int,
    max_q_width: int,
    max_context: int,
) -> steps.TreeVerifyRequest:
    """The core's tree verify; sizes checked before anything is decoded (InvalidArgument)."""
    v = req.verify_tree
    tree = tree_from_wire(
        v.draft_token_ids,
        v.parents,
        v.q,
        vocab_size,
        max_nodes=max_nodes,
        max_depth=max_nodes,  # a tree is never deeper than its nodes; the verifier checks the context
        max_q_width=max_q_width,
    )
    tail = token_ids_from_wire(v.token_ids, max_context, "verify_tree.token_ids")
    return steps.TreeVerifyRequest(req.session_id, req.committed_length, tree, v.start, tail)


def tree_verdict_to_proto(outcome: steps.TreeVerifyOutcome, resp: target_pb2.TargetResponse) -> None:
    resp.committed_length = outcome.committed_length
    v = resp.tree_verdict
    v.path.extend(outcome.path)
    v.token_id = outcome.token_id
    v.kind = target_pb2.TOKEN_KIND_BONUS if outcome.is_bonus else target_pb2.TOKEN_KIND_RECOVERED
    v.compute_ms = outcome.compute_ms
    v.batch_size = outcome.phases.batch_size
    v.batch_tokens = outcome.phases.batch_tokens


def tree_verdict_from_proto(
    resp: target_pb2.TargetResponse, tree: DraftTree, vocab_size: int | None = None
) -> steps.TreeVerifyOutcome:
    """The verdict on `tree`; one that cannot belong to it (a path that is not one, a token outside the
    vocabulary) is a target out of step: Unavailable, retried like verdict_from_proto's."""
    v = resp.tree_verdict
    path = tuple(int(i) for i in v.path)
    if path and not tree.is_path(path):
        raise Unavailable(f"the target accepted nodes {list(path)}, not a path from the prefix of the tree it was sent")
    if vocab_size is not None and not 0 <= v.token_id < vocab_size:
        raise Unavailable(f"the target sent token id {v.token_id}, outside the vocabulary [0, {vocab_size})")
    return steps.TreeVerifyOutcome(
        path=path,
        tokens=tuple(tree.token_ids[i] for i in path),
        token_id=v.token_id,
        is_bonus=v.kind == target_pb2.TOKEN_KIND_BONUS,
        committed_length=resp.committed_length,
        compute_ms=reported_ms(v.compute_ms),
        phases=PhaseLog(batch_size=max(1, v.batch_size), batch_tokens=v.batch_tokens),
    )
