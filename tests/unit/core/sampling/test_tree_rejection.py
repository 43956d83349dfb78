"""Table-driven tests of specd.core.sampling.tree_rejection (statistics: tests/slow/test_tree_stats.py)."""

from __future__ import annotations

import random

import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.sampling.rejection import SparseProposal, rejection_sample
from specd.core.sampling.sampler import Role, SamplingParams, coins, processed_probs, sample_sparse
from specd.core.sampling.tree import COIN_STRIDE, DraftTree, TreeBatch
from specd.core.sampling.tree_rejection import (
    TreeVerdict,
    tree_greedy_verdict,
    tree_rejection_row,
    tree_rejection_sample,
)
from tests.unit.core.sampling import reference

F32, F64, I64 = torch.float32, torch.float64, torch.int64
ONE = {0: [1, 0, 0, 0], 1: [0, 1, 0, 0], 2: [0, 0, 1, 0], 3: [0, 0, 0, 1]}  # one-hot rows over V = 4


def _verify(p_rows, tokens, parents, q=(), seed=0, start=5) -> TreeVerdict:
    """One tree's verdict: p_rows [N+1][V] (row 0 after the prefix, 1+i after node i)."""
    tree = DraftTree.from_wire(tokens, parents, list(q), 4)
    p = torch.tensor([p_rows], dtype=F32)
    v = tree_rejection_sample(p, TreeBatch.of([tree]), torch.tensor([seed]), torch.tensor([start])).row(0)
    # The verifier's host walk (p read row by row) must give the same verdict, coin for coin.
    assert tree_rejection_row(lambda i: p[0, i].to(F64).numpy(), tree, seed, start) == v
    return v


def test_the_host_walk_equals_the_batched_rule_on_random_trees() -> None:
    """Random trees (up to 12 nodes, siblings of up to 4), p rows and sparse q with repeats, 300 seeds:
    tree_rejection_row's verdict is tree_rejection_sample's, and it reads p at accepted nodes only."""
    rng = random.Random(7)
    V = 12
    for seed in range(300):
        n = rng.randrange(0, 13)
        parents = [rng.randrange(-1, i) for i in range(n)]
        tokens = [rng.randrange(V) for _ in range(n)]
        q = []
        for t in tokens:
            ids = [t] + [rng.randrange(V) for _ in range(rng.randrange(0, 5))]  # repeats allowed
            q.append((ids, [rng.choice([0.0, rng.random()]) + 0.05 for _ in ids]))
        tree = DraftTree.from_wire(tokens, parents, q if seed % 3 else [], V)
        p = torch.softmax(torch.randn(1, n + 1, V, generator=torch.Generator().manual_seed(seed)) * 2, -1)
        want = tree_rejection_sample(p, TreeBatch.of([tree]), torch.tensor([seed]), torch.tensor([9])).row(0)
        read: list[int] = []

        def read_p(i: int, p: torch.Tensor = p, read: list[int] = read) -> object:
            read.append(i)
            return p[0, i].to(F64).numpy()

        assert tree_rejection_row(read_p, tree, seed, 9) == want, seed
        assert read == [0] + [c + 1 for c in want.accepted]


# Each case: p rows, tokens, parents, q rows (none: one-hot), expected verdict. Chosen to hold for
# every coin (acceptance ratios 0 or >= 1, one-hot residuals).
CASES = {
    "empty tree -> bonus from p after the prefix": ([ONE[2]], [], [], (), ((), 2, True)),
    "first child rejected, second accepted, leaf -> bonus": (
        [ONE[1], ONE[3], ONE[0]],
        [2, 1],
        [-1, -1],
        (),
        ((1,), 0, True),
    ),
    "all children rejected -> recovered": ([ONE[0], ONE[3], ONE[3]], [2, 3], [-1, -1], (), ((), 0, False)),
    "residual renormalised between siblings": (
        # child 0 (token 2, p = 0) is rejected; r = normalise(max(0, p - q0)) = one-hot at 1, so
        # child 1 (token 1, q one-hot) has ratio r(1) / q(1) = 1: accepted at every coin. Without
        # the renormalisation its ratio would be 0.5.
        [[0.5, 0.5, 0, 0], ONE[3], ONE[3]],
        [2, 1],
        [-1, -1],
        [([2, 0], [0.5, 0.5]), ([1], [1.0])],
        ((1,), 3, True),
    ),
    "descend, second grandchild accepted, bonus": (
        [ONE[0], ONE[1], ONE[2], ONE[3]],
        [0, 3, 1],  # node 0 under the prefix, nodes 1 and 2 under node 0
        [-1, 0, 0],
        (),
        ((0, 2), 3, True),  # the bonus from p after node 2 (row 3)
    ),
    "descend, grandchildren rejected -> recovered at depth 2": (
        [ONE[3], ONE[0], ONE[1], ONE[0], ONE[0]],
        [2, 3, 0, 0],  # the prefix's children 2 (rejected) and 3 (accepted), node 1's children 0, 0 (p: 1)
        [-1, -1, 1, 1],
        (),
        ((1,), 1, False),
    ),
    "subtree of a rejected sibling is never visited": (
        [ONE[1], ONE[0], ONE[0], ONE[2]],
        [3, 0, 1],  # node 0 (rejected) has child 1 (token 0 = p after node 0's argmax), node 2 accepted
        [-1, 0, -1],
        (),
        ((2,), 2, True),
    ),
}


@pytest.mark.parametrize("seed", [0, 1, 17])
@pytest.mark.parametrize("name", list(CASES))
def test_table(name, seed):
    p_rows, tokens, parents, q, (path, token, bonus) = CASES[name]
    assert _verify(p_rows, tokens, parents, q, seed) == TreeVerdict(path, token, bonus)


def test_sibling_coins_follow_the_hand_computation():
    """p uniform over 4; children 3 then 2 then 1, q one-hot: ratios 1/4, 1/3, 1/2 with coins at slots 0, 1, 2."""
    p = [[0.25] * 4, ONE[0], ONE[0], ONE[0]]
    for seed in range(60):
        u = [float(coins(torch.tensor([seed]), torch.tensor([[5 + k * COIN_STRIDE]]), Role.ACCEPT)) for k in range(3)]
        want: TreeVerdict
        if u[0] < 1 / 4:
            want = TreeVerdict((0,), 0, True)
        elif u[1] < 1 / 3:
            want = TreeVerdict((1,), 0, True)
        elif u[2] < 1 / 2:
            want = TreeVerdict((2,), 0, True)
        else:  # residual: one-hot at 0, recovered with the RECOVER coin (any coin gives 0)
            want = TreeVerdict((), 0, False)
        assert _verify(p, [3, 2, 1], [-1, -1, -1], seed=seed) == want


def test_chain_tree_is_rejection_sample_bit_for_bit():
    """A chain tree gets the chain verifier's verdict for every seed (same coins, same residual)."""
    g = torch.Generator().manual_seed(3)
    B, K, V = 3000, 3, 6
    p = processed_probs(torch.randn(B, K + 1, V, generator=g) * 2, [SamplingParams()] * B)
    q = torch.softmax(torch.randn(B, K, V, generator=g) + 0.5 * p[:, :K].log().clamp(min=-30), -1).float()
    ids = torch.arange(V).expand(B, K, V).contiguous()
    seeds, start = torch.arange(B) * 5 + 1, torch.full((B,), 40)
    draws = [sample_sparse(ids[:, i], q[:, i], coins(seeds, (start + i)[:, None], Role.DRAFT)[:, 0]) for i in range(K)]
    drafts = torch.stack(draws, 1)
    chain = rejection_sample(p, drafts, SparseProposal(ids, q), seeds, start)
    trees = TreeBatch.of([DraftTree.chain(drafts[b].tolist(), ids[b], q[b]) for b in range(B)])
    tv = tree_rejection_sample(p, trees, seeds, start)
    assert torch.equal(tv.num_accepted, chain.num_accepted)
    assert torch.equal(tv.next_token, chain.next_token) and torch.equal(tv.is_bonus, chain.is_bonus)
    # one-hot q (n-gram chains) too
    chain1 = rejection_sample(p, drafts, None, seeds, start)
    tv1 = tree_rejection_sample(p, TreeBatch.of([DraftTree.chain(d) for d in drafts.tolist()]), seeds, start)
    assert torch.equal(tv1.num_accepted, chain1.num_accepted) and torch.equal(tv1.next_token, chain1.next_token)
    assert 0 < int((chain.num_accepted == 0).sum()) < B and int(chain.is_bonus.sum()) > 0  # both outcomes occur


def test_batch_rows_are_independent_of_their_batch_mates():
    a = DraftTree.from_wire([2, 1, 0], [-1, -1, 1], [], 4)
    b = DraftTree.from_wire([1], [-1], [], 4)
    pa = torch.tensor([[0.1, 0.6, 0.2, 0.1], ONE[0], [0.3, 0.3, 0.2, 0.2], ONE[1]], dtype=F32)
    pb = torch.tensor([[0.2, 0.3, 0.4, 0.1], [0.5, 0.5, 0, 0]], dtype=F32)
    both = torch.zeros(2, 4, 4)
    both[0], both[1, :2] = pa, pb
    seeds, start = torch.tensor([9, 4]), torch.tensor([3, 8])
    batched = tree_rejection_sample(both, TreeBatch.of([a, b]), seeds, start)
    alone_a = tree_rejection_sample(pa[None], TreeBatch.of([a]), seeds[:1], start[:1]).row(0)
    alone_b = tree_rejection_sample(pb[None], TreeBatch.of([b]), seeds[1:], start[1:]).row(0)
    assert batched.row(0) == alone_a and batched.row(1) == alone_b


def test_bonus_and_recovered_use_the_chain_coins():
    """Empty tree: the bonus is the chain's, the race over p at the start position (bonus_race)."""
    p = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    for seed in range(20):
        want = reference.bonus_race(p[0, 0], seed, 12)
        assert tree_rejection_sample(
            p, TreeBatch.of([DraftTree.chain([])]), torch.tensor([seed]), torch.tensor([12])
        ).row(0) == TreeVerdict((), want, True)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(p=torch.zeros(1, 2, 4)), r"\[B, N\]"),
        (dict(p=torch.zeros(2, 4)), r"\[B, N\+1, V\]"),
        (dict(seeds=torch.tensor([1, 2])), "seeds"),
        (dict(tree=DraftTree((5,), (-1,))), r"\[0, 4\)"),
        (dict(tree=DraftTree((1,), (-1,), torch.tensor([[2]]), torch.tensor([[1.0]]))), "support"),
    ],
)
def test_bad_input_raises(change, match):
    tree = change.get("tree", DraftTree.chain([1, 2]))
    p = change.get("p", torch.full((1, len(tree) + 1, 4), 0.25))
    with pytest.raises(InvalidArgument, match=match):
        tree_rejection_sample(p, TreeBatch.of([tree]), change.get("seeds", torch.tensor([1])), torch.tensor([0]))


# ---- greedy ---------------------------------------------------------------------------------


def _logits(argmaxes: list[int], V: int = 4) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), V)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return out


GREEDY = {
    "empty tree": ([], [], [2], ((), 2, True)),
    "deepest argmax path wins over an earlier shallower one": (
        # nodes 0 and 1 are both the argmax (1) after the prefix; only node 1 continues (its child 2 is argmax 3)
        [1, 1, 3],
        [-1, -1, 1],
        [1, 0, 3, 2],
        ((1, 2), 2, True),
    ),
    "ties go to the lowest node index": ([1, 1], [-1, -1], [1, 0, 0], ((0,), 0, True)),
    "no child matches -> recovered (the argmax)": ([0, 2], [-1, -1], [3, 0, 0], ((), 3, False)),
    "matching node with children that do not match": ([1, 0, 2], [-1, 0, 0], [1, 3, 0, 0], ((0,), 3, False)),
}


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_table(name):
    tokens, parents, argmaxes, (path, token, bonus) = GREEDY[name]
    tree = DraftTree.from_wire(tokens, parents, [], 4)
    assert tree_greedy_verdict(_logits(argmaxes), tree) == TreeVerdict(path, token, bonus)


def test_greedy_tokens_equal_the_sampled_rule_at_temperature_zero():
    """p one-hot: the sampled rule takes the first matching child, greedy the deepest: the same tokens.

    Logits are a function of each node's path (as a model's are), so duplicate siblings agree."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(4**6, 3, generator=g)  # logits by path code

    def row(path_tokens: list[int]) -> torch.Tensor:
        return table[sum((t + 1) * 4**j for j, t in enumerate(path_tokens))]

    for trial in range(50):
        n = 7
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, 3, (n,), generator=g).tolist()
        tree = DraftTree.from_wire(tokens, parents, [], 3)
        logits = torch.stack([row([])] + [row([tokens[j] for j in tree.path_to(i)]) for i in range(n)])
        greedy = tree_greedy_verdict(logits, tree)
        p = torch.zeros(1, n + 1, 3).scatter_(-1, logits.argmax(-1)[None, :, None], 1.0)
        sampled = tree_rejection_sample(p, TreeBatch.of([tree]), torch.tensor([trial]), torch.tensor([0])).row(0)
        assert greedy is not None
        spelled, greedy_spelled = (spell(tree, v) for v in (sampled, greedy))
        assert spelled == greedy_spelled[: len(spelled)]
        assert greedy.num_accepted >= sampled.num_accepted


def spell(tree: DraftTree, v: TreeVerdict) -> list[int]:
    """The tokens a verdict emits: its path's, then the next token."""
    return [tree.token_ids[i] for i in v.accepted] + [v.next_token]


def test_greedy_unusable_logits_and_shape():
    tree = DraftTree.chain([1])
    bad = _logits([1, 2])
    bad[1, 0] = float("nan")
    assert tree_greedy_verdict(bad, tree) is None
    with pytest.raises(InvalidArgument, match="N\\+1=2"):
        tree_greedy_verdict(_logits([1]), tree)
