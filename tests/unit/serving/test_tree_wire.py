"""Tree speculation's wire messages (specd.serving.tree_wire): round trips, limits before allocation, verdicts."""

from __future__ import annotations

import pytest
import torch

from specd.core.errors import InvalidArgument, Unavailable
from specd.core.phases import PhaseLog
from specd.core.rounds import steps
from specd.core.sampling import compact_q
from specd.core.sampling.tree import DraftTree
from specd.serving import tree_wire
from specd.v1 import common_pb2, draft_pb2, target_pb2

V = 50


def _tree(weights: list[list[float]] | None) -> DraftTree:
    """4 nodes: two children of the prefix, a grandchild under each; q rows padded to width 3."""
    tokens, parents = (7, 3, 9, 1), (-1, -1, 0, 1)
    if weights is None:
        return DraftTree.from_wire(tokens, parents, (), V)
    rows = [([t, (t + 5) % V, 0], w) for t, w in zip(tokens, weights)]
    return DraftTree.from_wire(tokens, parents, rows, V)


def _q(tree: DraftTree) -> list[dict[int, float]]:
    """Per node, q as a normalised {id: probability} (padding and zero entries dropped)."""
    assert tree.q_ids is not None and tree.q_probs is not None
    out = []
    for ids, probs in zip(tree.q_ids.tolist(), tree.q_probs.tolist()):
        row: dict[int, float] = {}
        for i, p in zip(ids, probs):
            if p > 0:
                row[i] = row.get(i, 0.0) + p
        total = sum(row.values())
        out.append({i: p / total for i, p in row.items()})
    return out


@pytest.mark.parametrize(
    "weights",
    [
        [[600, 400, 0], [900, 100, 0], [1000, 0, 0], [500, 500, 0]],  # integer weights (a model draft's): compact
        [[0.6, 0.4, 0], [0.9, 0.1, 0], [1.0, 0, 0], [0.25, 0.75, 0]],  # plain
        None,  # one-hot (n-gram, suffix tries)
    ],
)
def test_a_tree_crosses_the_draft_and_target_wires_unchanged(weights) -> None:
    tree = _tree(weights)
    msg = tree_wire.draft_tree_to_proto(tree, compute_ms=2.5, batch_size=3)
    assert msg.parents == [-1, -1, 0, 1]
    if weights is not None:
        compact = isinstance(weights[0][0], int)
        assert all(bool(d.id_gaps) == compact and bool(d.token_ids) != compact for d in msg.q)
    back = tree_wire.draft_tree_from_proto(
        draft_pb2.DraftTree.FromString(msg.SerializeToString()), V, budget=4, depth=2
    )
    request = steps.TreeVerifyRequest("s", 10, back, start=10, tail=())
    wire = target_pb2.TargetRequest.FromString(tree_wire.verify_tree_request(request, {}).SerializeToString())
    at_target = tree_wire.verify_tree_from_proto(wire, V, max_nodes=32, max_q_width=64, max_context=100)
    # The coordinator relays q undecoded (the rows as the draft sent them); the target decodes them.
    assert back.q_ids is None and back.wire_q == (None if weights is None else tuple(msg.q))
    got = at_target.tree
    assert got.token_ids == tree.token_ids and got.parents == tree.parents
    if weights is None:
        assert got.q_ids is None
    else:
        for g, t in zip(_q(got), _q(tree)):
            assert g.keys() == t.keys() and all(g[k] == pytest.approx(t[k], abs=1e-6) for k in g)
    assert at_target.committed_length == 10 and at_target.start == 10


def test_the_draft_tree_call_round_trips_and_refuses_its_limits() -> None:
    r = steps.TreeProposeRequest("s", 9, 7, [4, 5], budget=8, depth=3)
    msg = tree_wire.tree_propose_request(r, {"traceparent": "x"})
    assert msg.WhichOneof("op") == "tree"
    assert tree_wire.tree_propose_from_proto(msg, max_budget=32, max_depth=32) == r
    for budget, depth, needle in (
        (0, 3, "budget must be in 1..32"),
        (33, 3, "budget"),
        (8, 0, "depth"),
        (8, 40, "depth"),
    ):
        msg.tree.budget, msg.tree.depth = budget, depth
        with pytest.raises(InvalidArgument, match=needle):
            tree_wire.tree_propose_from_proto(msg, max_budget=32, max_depth=32)


def test_a_draft_tree_over_the_request_is_refused() -> None:
    msg = tree_wire.draft_tree_to_proto(_tree(None))
    with pytest.raises(InvalidArgument, match="at most 3"):
        tree_wire.draft_tree_from_proto(msg, V, budget=3, depth=2)
    with pytest.raises(InvalidArgument, match="at most 1 deep"):
        tree_wire.draft_tree_from_proto(msg, V, budget=4, depth=1)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        tree_wire.draft_tree_from_proto(msg, 5, budget=4, depth=2)
    # q's numbers are the target's to check, its rows' count and form the coordinator's.
    msg.q.add(token_ids=[1], probs=[1.0])
    with pytest.raises(InvalidArgument, match="q has 1 rows for 4 tree nodes"):
        tree_wire.draft_tree_from_proto(msg, V, budget=4, depth=2)
    msg.q.add(token_ids=[1], probs=[1.0], weights=b"\x01")
    del msg.q[0]
    msg.q.extend([common_pb2.SparseDistribution(token_ids=[1], probs=[1.0])] * 3)
    with pytest.raises(InvalidArgument, match="exactly one of the plain and the compact"):
        tree_wire.draft_tree_from_proto(msg, V, budget=4, depth=2)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda v: v.draft_token_ids.extend([1] * 40), "at most 32"),  # parents need not be read
        (lambda v: v.parents.extend([0, 5]), "parent"),
        (lambda v: v.q.add(id_gaps=bytes(range(1, 70)), weights=b"\x01" * 69), "has 69 entries; the limit is 50"),
        (lambda v: v.q.add(token_ids=[1], probs=[1.0], weights=b"\x01"), "exactly one of the plain and the compact"),
        (lambda v: v.q.add(id_gaps=b"\x01", weights=b"\x01"), "q has 1 rows for 2 tree nodes"),
    ],
)
def test_the_target_checks_sizes_before_it_decodes_or_allocates(monkeypatch, mutate, needle) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("decoded or allocated before the size checks")

    req = target_pb2.TargetRequest(session_id="s", committed_length=3)
    v = req.verify_tree
    v.draft_token_ids.extend([1, 2])
    v.parents.extend([-1, 0])
    mutate(v)
    if len(v.q) == 1 and len(v.draft_token_ids) == 2 and "rows" not in needle:
        v.q.add(id_gaps=b"\x02", weights=b"\x01")  # one row per node, so the row's own check is what refuses
    monkeypatch.setattr(torch, "zeros", refuse)
    monkeypatch.setattr(compact_q, "from_compact", refuse)
    with pytest.raises(InvalidArgument, match=needle):
        tree_wire.verify_tree_from_proto(req, V, max_nodes=32, max_q_width=64, max_context=100)


def test_a_tree_verdict_round_trips_and_one_off_the_tree_is_refused() -> None:
    tree = _tree(None)
    out = steps.TreeVerifyOutcome((1, 3), (3, 1), 12, True, 13, 4.0, PhaseLog(batch_size=2, batch_tokens=9))
    resp = target_pb2.TargetResponse(request_id=1, session_id="s")
    tree_wire.tree_verdict_to_proto(out, resp)
    assert resp.WhichOneof("result") == "tree_verdict" and resp.tree_verdict.kind == target_pb2.TOKEN_KIND_BONUS
    back = tree_wire.tree_verdict_from_proto(resp, tree, V)
    assert back == out and back.phases.batch_tokens == 9
    resp.tree_verdict.path[:] = [0, 3]  # node 3 is not node 0's child
    with pytest.raises(Unavailable, match="not a path"):
        tree_wire.tree_verdict_from_proto(resp, tree, V)
    resp.tree_verdict.path[:] = [0]
    resp.tree_verdict.token_id = V
    with pytest.raises(Unavailable, match="outside the vocabulary"):
        tree_wire.tree_verdict_from_proto(resp, tree, V)
