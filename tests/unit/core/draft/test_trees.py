"""Drafters' trees: the model drafter's expansion (budget, depth, the chain at width 1, draws without
replacement) and the n-gram and suffix drafters' candidates as one-hot tries."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.model_tree import children_counts
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.draft.trees import candidate_tree, propose_trees
from specd.core.errors import InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest, TreeProposeRequest
from specd.core.sampling.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    _, draft = tiny_pair
    d = load_pretrained(draft)
    return d.tokenizer, ModelDrafter(CausalLMRunner(d.model))


def _tree(drafter, prompt, params, budget, depth, **shape):
    drafter.open("t", prompt, params)
    tree = propose_trees(drafter, [TreeProposeRequest("t", len(prompt), len(prompt), [], budget, depth)], **shape)[0]
    drafter.close("t")
    assert not isinstance(tree, Exception)
    return tree


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=4)])
def test_width_one_is_the_chain_drafters_proposal(tiny, params: SamplingParams) -> None:
    tok, drafter = tiny
    prompt = tok("def f(x):").input_ids
    tree = _tree(drafter, prompt, params, 5, 5, width=1, beam=1)
    drafter.open("c", prompt, params)
    chain = drafter.propose(ProposeRequest("c", len(prompt), len(prompt), [], 5))
    drafter.close("c")
    assert tree.is_chain and list(tree.token_ids) == chain.token_ids
    # The q each node records is the chain's up to float noise: the tree pass and the chain's cached
    # passes round differently (~1e-6), which can move an integer weight by one unit.
    if chain.q_probs is not None:
        assert tree.q_probs is not None and tree.q_ids is not None and chain.q_ids is not None
        for k in range(5):
            w = int((chain.q_probs[k] > 0).sum())
            assert torch.equal(tree.q_ids[k, :w], chain.q_ids[k, :w])
            assert torch.allclose(tree.q_probs[k, :w], chain.q_probs[k, :w], atol=2.0)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=9)])
def test_expansion_keeps_the_budget_and_depth_and_siblings_differ(tiny, params: SamplingParams) -> None:
    tok, drafter = tiny
    prompt = tok("hello world").input_ids
    tree = _tree(drafter, prompt, params, 10, 4, width=3, beam=3)
    assert len(tree) == 10
    if params.is_greedy:  # EAGLE-2's rerank: the 10 likeliest paths, however deep they reach
        assert tree.depth <= 4
    else:  # every draw is kept: one node left for each level to come
        assert tree.depth == 4
    for kids in tree.children:
        assert len(kids) <= 3
        assert len({tree.token_ids[c] for c in kids}) == len(kids)  # top-k or drawn without replacement
    assert len(tree.children[0]) == 3  # the prefix is always expanded first
    if params.is_greedy:  # depth 1: the draft's top 3 in order
        with torch.no_grad():
            logits = drafter.runner.model(torch.tensor([prompt])).logits[0, -1]
        assert [tree.token_ids[c] for c in tree.children[0]] == torch.topk(logits, 3).indices.tolist()
    else:
        assert tree.q_ids is not None
    again = _tree(drafter, prompt, params, 10, 4, width=3, beam=3)  # seeded: the same tree
    assert again.token_ids == tree.token_ids and again.parents == tree.parents


def test_batched_trees_equal_each_alone(tiny) -> None:
    tok, drafter = tiny
    prompts = [tok(t).input_ids for t in ("abc", "The end.", "x")]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), GREEDY]
    alone = [_tree(drafter, p, q, b, 3) for p, q, b in zip(prompts, params, (6, 4, 2))]
    for i, (p, q) in enumerate(zip(prompts, params)):
        drafter.open(f"b{i}", p, q)
    reqs = [TreeProposeRequest(f"b{i}", len(p), len(p), [], b, 3) for i, (p, b) in enumerate(zip(prompts, (6, 4, 2)))]
    for a, b in zip(alone, propose_trees(drafter, reqs)):
        assert not isinstance(b, Exception) and (a.token_ids, a.parents) == (b.token_ids, b.parents)
    for i in range(3):
        drafter.close(f"b{i}")


def test_candidates_merge_into_a_trie_within_budget_and_depth() -> None:
    tree = candidate_tree([[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]], budget=5, depth=2, vocab_size=10)
    assert tree.token_ids == (1, 2, 5, 6, 7) and tree.parents == (-1, 0, -1, 2, 0)
    assert tree.q_ids is None  # one-hot nodes


def test_ngram_and_suffix_trees_hold_several_continuations() -> None:
    seq = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2]  # "1 2" was followed by 3 and by 4
    ngram = NgramDrafter(16, cap_at_match=False)
    ngram.open("n", seq, GREEDY)
    (tree,) = propose_trees(ngram, [TreeProposeRequest("n", len(seq), len(seq), [], 8, 2)])
    assert not isinstance(tree, Exception)
    assert sorted(tree.token_ids[c] for c in tree.children[0]) == [3, 4]
    suffix = SuffixDrafter(16)
    suffix.open("s", seq, GREEDY)
    (tree,) = propose_trees(suffix, [TreeProposeRequest("s", len(seq), len(seq), [], 8, 2)])
    assert not isinstance(tree, Exception) and {3, 4} <= {tree.token_ids[c] for c in tree.children[0]}
    bad = propose_trees(suffix, [TreeProposeRequest("s", len(seq), len(seq), [], 0, 2)])[0]
    assert isinstance(bad, InvalidArgument)


def test_a_sampled_levels_children_go_where_they_add_the_most_acceptance() -> None:
    """One child at a time to the parent whose next child is worth most: path probability x the q mass
    of its next-likeliest token. The likelier parent's sure q gives its first child, then the second
    parent's first two beat the first parent's second (0.2 x 0.6 and 0.2 x 0.4 against 0.7 x 0.05)."""
    scores = [math.log(0.7), math.log(0.2)]
    weights = np.array([[90.0, 5.0, 5.0], [60.0, 40.0, 0.0]], dtype=np.float32)  # slots by decreasing weight
    assert children_counts(scores, weights, width=6, allowance=3) == [1, 2]
    assert children_counts(scores, weights, width=6, allowance=4) == [2, 2]
    assert children_counts(scores, weights, width=6, allowance=9) == [3, 2]  # no more than a row's tokens
    assert children_counts(scores, weights, width=1, allowance=9) == [1, 1]  # nor than width
    assert children_counts(scores, weights, width=6, allowance=1) == [1, 0]
