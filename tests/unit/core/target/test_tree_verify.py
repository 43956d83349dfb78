"""The verifier's tree verify: each path verifies as its chain would, the tree as its best path, batched or alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import InvalidArgument
from specd.core.inprocess import speculative_generate
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest, TreeVerifyRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    return t, Verifier(CausalLMRunner(t.model)), ModelDrafter(CausalLMRunner(d.model))


def _chain(verifier: Verifier, prompt: list[int], tokens: list[int], params: SamplingParams, proposal=None):
    verifier.open("chain", prompt, params)
    out = verifier.verify(VerifyRequest("chain", len(prompt), proposal or Proposal(tokens)))
    verifier.close("chain")
    return out


def _tree(verifier: Verifier, prompt: list[int], tree: DraftTree, params: SamplingParams, sid: str = "tree"):
    verifier.open(sid, prompt, params)
    out = verifier.verify_tree(TreeVerifyRequest(sid, len(prompt), tree))
    verifier.close(sid)
    return out


def _random_tree(rng: random.Random, greedy: list[int], n: int, vocab: int) -> DraftTree:
    """n nodes, each under a random earlier node (or the prefix); tokens often the greedy continuation's."""
    tokens, parents, depths = [], [], []
    for i in range(n):
        p = rng.randrange(-1, i)
        d = 1 if p < 0 else depths[p] + 1
        on = d <= len(greedy) and rng.random() < 0.6
        tokens.append(greedy[d - 1] if on else rng.randrange(vocab))
        parents.append(p)
        depths.append(d)
    return DraftTree.from_wire(tokens, parents, [], vocab)


def test_every_path_verifies_as_its_chain_and_the_tree_as_its_best_path(tiny) -> None:
    loaded, verifier, _ = tiny
    rng = random.Random(0)
    for text in ["hello world", "def f(x):"]:
        prompt = loaded.tokenizer(text).input_ids
        greedy = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=6).token_ids
        for n in (1, 5, 9):
            tree = _random_tree(rng, greedy, n, verifier.vocab_size)
            best = None
            for path in tree.paths():
                tokens = [tree.token_ids[i] for i in path]
                chain = _chain(verifier, prompt, tokens, GREEDY)
                alone = _tree(verifier, prompt, DraftTree.chain(tokens), GREEDY)  # the path as a tree of its own
                assert (alone.accepted, alone.token_id, alone.is_bonus) == (
                    chain.accepted,
                    chain.token_id,
                    chain.is_bonus,
                )
                assert alone.committed_length == chain.committed_length
                if best is None or chain.accepted > best[0]:
                    best = (chain.accepted, tokens[: chain.accepted] + [chain.token_id])
            out = _tree(verifier, prompt, tree, GREEDY)
            assert best is not None and out.accepted == best[0]
            assert [*out.tokens, out.token_id] == best[1] == greedy[: best[0] + 1]  # target-only's tokens


def test_batched_trees_of_different_sizes_match_each_alone(tiny) -> None:
    loaded, verifier, _ = tiny
    rng = random.Random(1)
    prompts = [loaded.tokenizer(t).input_ids for t in ["abc abc", "The end.", "x"]]
    greedy = [
        speculative_generate(p, verifier, None, GREEDY, draft_length=0, max_new_tokens=4).token_ids for p in prompts
    ]
    trees = [_random_tree(rng, g, n, verifier.vocab_size) for g, n in zip(greedy, (7, 0, 3))]
    alone = [_tree(verifier, p, t, GREEDY) for p, t in zip(prompts, trees)]
    for i, p in enumerate(prompts):
        verifier.open(f"b{i}", p, GREEDY)
    batch = verifier.verify_tree_batch(
        [TreeVerifyRequest(f"b{i}", len(p), t) for i, (p, t) in enumerate(zip(prompts, trees))]
    )
    for i, (a, b) in enumerate(zip(alone, batch)):
        assert not isinstance(b, Exception)
        assert (a.path, a.token_id, a.committed_length) == (b.path, b.token_id, b.committed_length)
        verifier.close(f"b{i}")


def test_a_seeded_chain_tree_gets_the_chain_verdict(tiny) -> None:
    """T > 0: a chain with the draft's sparse q verifies through the tree rule exactly as through the chain's."""
    loaded, verifier, drafter = tiny
    prompt = loaded.tokenizer("sampling").input_ids
    for seed in range(6):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        drafter.open("d", prompt, params)
        proposal = drafter.propose(ProposeRequest("d", len(prompt), len(prompt), [], 4))
        drafter.close("d")
        chain = _chain(verifier, prompt, proposal.token_ids, params, proposal)
        tree = _tree(verifier, prompt, DraftTree.chain(proposal.token_ids, proposal.q_ids, proposal.q_probs), params)
        assert (tree.accepted, tree.token_id, tree.is_bonus) == (chain.accepted, chain.token_id, chain.is_bonus)


def test_bad_trees_fail_alone_with_a_message(tiny) -> None:
    loaded, verifier, _ = tiny
    prompt = loaded.tokenizer("hi").input_ids
    verifier.open("ok", prompt, GREEDY)
    verifier.open("bad", prompt, GREEDY)
    deep = DraftTree.chain([1] * (verifier.runner.max_context))
    ok, bad = verifier.verify_tree_batch(
        [TreeVerifyRequest("ok", len(prompt), DraftTree.chain([5])), TreeVerifyRequest("bad", len(prompt), deep)]
    )
    assert not isinstance(ok, Exception) and ok.committed_length == len(prompt) + ok.accepted + 1
    assert isinstance(bad, InvalidArgument)
    verifier.close("ok")
    verifier.close("bad")
