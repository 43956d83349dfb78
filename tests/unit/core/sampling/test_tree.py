"""specd.core.sampling.tree and tree_draft: the draft tree type, its limits, and drawing children."""

from __future__ import annotations

import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.sampling.sampler import Role, coins, draft_token, sample_sparse
from specd.core.sampling.tree import COIN_STRIDE, DraftTree, TreeBatch, coin_positions
from specd.core.sampling.tree_draft import TreeBuilder, draw_children

F32, I64 = torch.float32, torch.int64
#        0   1   2   3   4   5
# prefix -> 0 -> 2 -> 5
#        -> 0 -> 3
#        -> 1 -> 4
PARENTS = [-1, -1, 0, 0, 1, 2]
TOKENS = [10, 11, 12, 13, 14, 15]


def test_structure_helpers():
    t = DraftTree.from_wire(TOKENS, PARENTS, [], 20)
    assert t.depths == (1, 1, 2, 2, 2, 3) and t.depth == 3 and len(t) == 6
    assert t.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())
    assert t.paths() == [[0, 3], [1, 4], [0, 2, 5]]
    assert t.path_to(5) == [0, 2, 5] and t.path_to(-1) == []
    assert t.is_path([0, 2, 5]) and t.is_path([]) and not t.is_path([2]) and not t.is_path([0, 4])
    assert not t.is_chain and DraftTree.chain([1, 2, 3]).is_chain
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(t.ancestor_mask(), want)
    empty = DraftTree.from_wire([], [], [], 20)
    assert empty.depth == 0 and empty.paths() == [] and empty.children == ((),)


def test_first_path_and_subtree_keep_q_and_a_closed_prefix():
    q = [([t, t + 1], [3.0, 1.0]) for t in TOKENS]
    t = DraftTree.from_wire(TOKENS, PARENTS, q, 20)
    assert t.first_path() == [0, 2, 5] and DraftTree.from_wire([], [], [], 20).first_path() == []
    under0 = t.subtree(0, max_nodes=8, max_depth=8)  # nodes 2, 3, 5 re-rooted at the prefix + token 10
    assert under0.token_ids == (12, 13, 15) and under0.parents == (-1, -1, 0)
    assert under0.q_ids is not None and under0.q_ids[:, 0].tolist() == [12, 13, 15]
    assert under0.q_probs is not None and under0.q_probs[:, 0].tolist() == [3.0, 3.0, 3.0]
    assert t.subtree(0, max_nodes=2, max_depth=8).token_ids == (12, 13)  # the first nodes in node order
    assert t.subtree(0, max_nodes=8, max_depth=1).token_ids == (12, 13)  # one level under node 0
    assert t.subtree(1, max_nodes=8, max_depth=8).parents == (-1,) and len(t.subtree(5, 8, 8)) == 0
    relayed = DraftTree(t.token_ids, t.parents, wire_q=tuple(f"row{i}" for i in range(6)))
    assert relayed.subtree(0, 8, 8).wire_q == ("row2", "row3", "row5")  # relayed rows follow their nodes


def test_batch_ranks_and_children_table_with_holes():
    a = DraftTree.from_wire(TOKENS, PARENTS, [], 20)
    b = DraftTree.from_wire([7, 8], [-1, -1], [], 20)
    batch = TreeBatch.of([a, b]).validated(20)
    assert batch.ranks().tolist() == [[0, 1, 0, 1, 0, 0], [0, 1, -1, -1, -1, -1]]
    table = batch.children_table()
    assert table.shape == (2, 7, 2)
    assert table[0].tolist() == [[0, 1], [2, 3], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert table[1, 0].tolist() == [0, 1] and (table[1, 1:] == -1).all()
    # a hole (node 1 absent): node 2 becomes rank 0... of node 0's children it already is; node 3 stays rank 1
    real = torch.tensor([[True, False, True, True, False, True]])
    holed = TreeBatch(batch.token_ids[:1], batch.parents[:1], real).validated(20)
    assert holed.ranks().tolist() == [[0, -1, 0, 1, -1, 0]]
    with pytest.raises(InvalidArgument, match="real node"):
        TreeBatch(
            batch.token_ids[:1], batch.parents[:1], torch.tensor([[False, True, True, True, True, True]])
        ).validated(20)


@pytest.mark.parametrize(
    "tokens, parents, q, kw, match",
    [
        ([1] * 5, [-1, 0, 1, 2, 3], [], dict(max_nodes=4), "at most 4"),
        ([1, 2, 3], [-1, 0, 1], [], dict(max_depth=2), "at most 2 deep"),
        ([1, 2], [-1, 1], [], {}, "earlier node"),
        ([1, 2], [-1, -2], [], {}, "earlier node"),
        ([1, 2], [-1], [], {}, "one parent per node"),
        ([1, 2], [-1, 0], [([1], [1.0])], {}, "one per node"),
        ([1, 99], [-1, 0], [], {}, "outside the vocabulary"),
        ([1], [-1], [([1, 2, 3], [1.0, 1.0, 1.0])], dict(max_q_width=2), "limit is 2"),
        ([1], [-1], [([2], [1.0])], {}, "probability 0"),
        ([1], [-1], [([1, 40], [1.0, 1.0])], {}, "outside the vocabulary"),
        ([1], [-1], [([1], [float("nan")])], {}, "not finite"),
        ([1], [-1], [([1], [])], {}, "equal, non-zero"),
    ],
)
def test_from_wire_refuses(tokens, parents, q, kw, match):
    with pytest.raises(InvalidArgument, match=match):
        DraftTree.from_wire(tokens, parents, q, 20, **kw)


def test_limits_are_checked_before_allocation(monkeypatch):
    """A tree at the node or depth limit is refused from lengths alone: no tensor is made."""

    def refuse(*args, **kwargs):
        raise AssertionError("allocated before the size checks")

    monkeypatch.setattr(torch, "zeros", refuse)
    q = [([1], [1.0])] * 10_000
    with pytest.raises(InvalidArgument, match="at most 256"):
        DraftTree.from_wire([1] * 10_000, list(range(-1, 9_999)), q, 20)
    with pytest.raises(InvalidArgument, match="at most 64 deep"):
        DraftTree.from_wire([1] * 65, list(range(-1, 64)), q[:65], 20)


def test_coin_slots():
    pos = torch.tensor([3, 7])
    assert coin_positions(pos, 0).tolist() == [3, 7]
    assert coin_positions(pos, torch.tensor([1, 2])).tolist() == [3 + COIN_STRIDE, 7 + 2 * COIN_STRIDE]


def test_draw_children_without_replacement_records_the_remainder():
    ids = torch.tensor([[4, 2, 9, 5]] * 3)
    wire = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F32)
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([5, 5, 5])
    tok, qs, drawn = draw_children(ids, wire, 3, seeds, pos)
    assert drawn.tolist() == [[True] * 3, [True, True, False], [True, False, False]]
    for b in range(3):
        seen: list[int] = []
        for i in range(int(drawn[b].sum())):
            t = int(tok[b, i])
            assert t not in seen
            # the q child i records: the wire with the earlier children's tokens zeroed, and t in it
            want = wire[b] * torch.tensor([int(x) not in seen for x in ids[b].tolist()])
            assert torch.equal(qs[b, i], want) and float(qs[b, i][ids[b] == t].sum()) > 0
            seen.append(t)
    # child 0 is the chain drafter's draw: the same q, the same coin (slot 0)
    u = coins(seeds, pos[:, None], Role.DRAFT)[:, 0]
    assert torch.equal(tok[:, 0], sample_sparse(ids, wire, u))
    # with replacement: every child records the full q
    _, qs_iid, drawn_iid = draw_children(ids, wire, 3, seeds, pos, replacement=True)
    assert drawn_iid.all() and torch.equal(qs_iid, wire[:, None].expand(3, 3, 4))


def test_one_child_per_node_tree_is_the_chain_drafter():
    """A TreeBuilder chain draws each token with the chain drafter's coin: the same tokens."""
    g = torch.Generator().manual_seed(0)
    qs = torch.softmax(torch.randn(4, 12, generator=g), -1)  # [K, V] the draft's p per depth
    seed, start = 77, 30
    b = TreeBuilder(seed, start)
    node = -1
    chain = []
    for d in range(4):
        tok, ids, wire = draft_token(qs[d : d + 1], 12, 16, torch.tensor([seed]), torch.tensor([start + d]))
        chain.append(int(tok))
        [(node,)] = b.draw_level([node], ids, wire, [1])
    tree = b.build(12)
    assert tree.is_chain and list(tree.token_ids) == chain


def test_builder_slots_and_mixed_nodes():
    b = TreeBuilder(seed=5, start_position=10)
    ids, wire = torch.arange(6), torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1, 0.0])
    [kids] = b.draw_level([-1], ids[None], wire[None], [3])
    assert kids == [0, 1, 2] and b._slots == {1: 3}
    b.draw_level([0, 1], ids[None].expand(2, -1), wire[None].expand(2, -1), [2, 2])
    assert b._slots == {1: 3, 2: 4}  # distinct coins for cousins at one depth
    fixed = b.add(2, 4)  # a deterministic candidate: one-hot q
    tree = b.build(6)
    assert tree.parents == (-1, -1, -1, 0, 0, 1, 1, 2) and tree.depths[fixed] == 2
    assert tree.q_probs is not None and tree.q_probs[fixed].tolist()[:1] == [1.0]
    assert len(set(tree.token_ids[:3])) == 3  # without replacement
    with pytest.raises(InvalidArgument):
        b.add(99, 1)
