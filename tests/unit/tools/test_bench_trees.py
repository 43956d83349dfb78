"""`specd bench`'s tree-N modes: their request options and their records (per depth, no chain theory)."""

from __future__ import annotations

import pytest

from specd.tools.bench import RequestResult, parse_modes, summarize


def test_tree_modes_name_their_budget_and_take_the_fixed_modes_depth() -> None:
    modes = {m.name: m for m in parse_modes("fixed-4,tree-16,tree-2", [4])}
    assert modes["tree-16"].request == {"speculation": "fixed", "draft_length": 4, "tree_budget": 16, "pipeline": False}
    assert modes["tree-2"].request["draft_length"] == 2  # never deeper than its nodes
    assert modes["tree-16"].draft_length is None  # no S(K): that is a chain's theory
    assert parse_modes("tree-16", [2, 8])[1].request["draft_length"] == 8  # the largest --draft-lengths K
    for bad in ("tree", "tree-0", "tree-16x0"):
        with pytest.raises(ValueError, match="node budget"):
            parse_modes(bad, [4])
    shallow = parse_modes("tree-16x2", [4])[1]  # tree-NxD: N nodes, D levels whatever the Ks
    assert shallow.name == "tree-16x2" and shallow.request["draft_length"] == 2
    assert shallow.request["tree_budget"] == 16
    piped = {m.name: m for m in parse_modes("pipelined-tree-16x2,pipelined-tree-8", [3])}
    assert piped["pipelined-tree-16x2"].request == {
        "speculation": "fixed", "draft_length": 2, "tree_budget": 16, "pipeline": True,
    }  # fmt: skip
    assert piped["pipelined-tree-8"].request["draft_length"] == 3 and piped["pipelined-tree-8"].draft_length is None
    with pytest.raises(ValueError, match="node budget"):
        parse_modes("pipelined-tree-0", [4])


def test_a_tree_record_counts_nodes_as_draft_tokens_and_acceptance_per_depth() -> None:
    (mode,) = parse_modes("tree-8", [3])[1:]
    # two rounds of 8-node trees, 3 deep: accepted depths 3 and 1, then one more token each
    stats = {"rounds": 2, "drafts": 2, "draft_tokens": 16, "accepted_tokens": 4, "accepted_per_position": [2, 1, 1]}
    result = RequestResult("a", token_ids=list(range(6)), round_tokens=[4, 2], stats=stats, ttft_s=0.01, itl_s=[0.002])
    rec = summarize(mode, 0.0, 1, [result], 1.0, max_new_tokens=6, cost={"c": 0.2})
    assert rec["tree_budget"] == 8 and rec["tree_depth"] == 3
    assert rec["mean_draft_length"] == 8.0 and rec["acceptance_length"] == 3.0
    assert rec["accepted_per_position"] == [2, 1, 1]  # per depth, not padded to the 8 nodes
    assert rec["acceptance_per_position"] == [1.0, 0.5, 0.5]
    assert rec["alpha"] is None and rec["theoretical_speedup"] is None
