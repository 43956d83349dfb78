"""The emulated accelerator verifies trees: rows are SimLM on each node's path, and a tree costs its node count."""

from __future__ import annotations

import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.model.sim import CostModel, SimLM, SimRunner, SimShape
from specd.core.sampling.tree import DraftTree

SMALL = SimShape(vocab_size=1000, context_tokens=3, head=16, seed=7)
COST = CostModel(fixed_ms=0.0, per_token_ms=0.25, free_tokens=2, per_seq_ms=0.5, per_kv_token_ms=0.01)


def _runner() -> SimRunner:
    slept: list[float] = []
    runner = SimRunner(SimLM(SMALL), COST, max_context=64, kv_bytes_per_token=10, sleep=slept.append)
    return runner


def test_tree_rows_are_the_function_of_each_path_and_keep_path_advances():
    runner, lm = _runner(), SimLM(SMALL)
    a, b = runner.new_session([5, 6, 7, 8]), runner.new_session([9])
    runner.logits(a, 1)
    tree = DraftTree.from_wire([11, 12, 13, 14], [-1, -1, 0, 2], [], 1000)
    ra, rb = runner.tree_logits_batch([a, b], [tree, DraftTree.chain([])])
    contexts = [a.tokens] + [a.tokens + [tree.token_ids[j] for j in tree.path_to(i)] for i in range(4)]
    assert torch.equal(ra.logits, lm.logits(contexts))
    assert torch.equal(rb.logits, lm.logits([b.tokens]))
    runner.keep_tree_path(a, ra, [0, 2, 3])
    assert a.tokens == [5, 6, 7, 8, 11, 13, 14] and a.cached == 7 and runner.kv_bytes(a) == 70
    with pytest.raises(InvalidArgument, match="context"):
        runner.tree_logits_batch([a], [DraftTree.chain([1] * 60)])


def test_a_tree_costs_its_node_count():
    """One pass: session b runs its uncached tokens plus N_b nodes, reads n_b + N_b positions."""
    runner = _runner()
    a, b = runner.new_session([1, 2, 3]), runner.new_session([4, 5])
    runner.logits(a, 1)  # a: cached; its last token reruns with the tree
    wide = DraftTree.from_wire([7] * 6, [-1] * 6, [], 1000)  # 6 nodes, depth 1
    deep = DraftTree.chain([7] * 3)
    before = runner.snapshot()
    runner.tree_logits_batch([a, b], [wide, deep])
    after = runner.snapshot()
    # a: 1 + 6 new positions, length 3 + 6; b: 2 + 3 new (nothing cached), length 2 + 3
    want = COST.forward_ms([7, 5], [9, 5])
    assert after.modelled_ms - before.modelled_ms == pytest.approx(want)
    assert after.positions - before.positions == 12 and after.rows - before.rows == 7 + 4
    # the same as a chain verify of as many drafts (verify_ms, a K = node-count chain after the same prefix)
    assert COST.verify_ms([6], [3]) == pytest.approx(COST.forward_ms([7], [9]))
    chain_session = runner.new_session([1, 2, 3])
    runner.logits(chain_session, 1)
    runner.append(chain_session, [7] * 6)
    t0 = runner.snapshot().modelled_ms
    runner.logits(chain_session, 7)
    assert runner.snapshot().modelled_ms - t0 == pytest.approx(COST.verify_ms([6], [3]))
