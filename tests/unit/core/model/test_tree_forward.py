"""Tree verification on CausalLMRunner: one pass with a 4D tree mask equals each path run as its own chain.

Logits of every root-to-leaf path equal the chain's (tree_logits_batch against fork + append +
logits), the KV after keep_tree_path equals the chain's, batched with different tree sizes and
cache states, on both tiny architectures with SDPA and eager attention; and tree speculation at
T = 0 spells target-only greedy decoding.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.tree_attention import tree_layout
from specd.core.sampling.tree import DraftTree
from specd.core.sampling.tree_rejection import tree_greedy_verdict

# Max abs difference between a tree's rows and the chain's: the same noise as batched against
# single passes (test_runner_batch.py: padding and the mask change float32 reduction order);
# measured here up to 4.5e-6 (Llama, SDPA). A node that sees a sibling, or sits at a wrong
# position, differs by 0.1 or more.
TOL = 2e-5


@pytest.fixture(scope="module", params=["llama", "gpt2", "llama-eager", "gpt2-eager"])
def runner(request: pytest.FixtureRequest, tiny_pair: tuple[Path, Path], tiny_gpt2_dir: Path) -> CausalLMRunner:
    path = tiny_pair[0] if request.param.startswith("llama") else tiny_gpt2_dir
    model = load_pretrained(path).model
    if request.param.endswith("eager"):
        model.set_attn_implementation("eager")
    return CausalLMRunner(model)


@pytest.fixture(scope="module")
def llama_runner(tiny_pair: tuple[Path, Path]) -> CausalLMRunner:
    return CausalLMRunner(load_pretrained(tiny_pair[0]).model)


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)] if n else []
    return DraftTree.from_wire([rng.randrange(vocab) for _ in range(n)], parents, [], vocab)


def sessions_in_states(r: CausalLMRunner, rng: random.Random) -> list[KVSession]:
    """Uncached, fully cached, cached but for appended tokens, rolled back."""
    out = []
    for kind, n in enumerate([9, 17, 5, 23]):
        s = r.new_session([rng.randrange(256) for _ in range(n)])
        if kind == 1:
            r.logits(s, 1)
        elif kind == 2:
            r.logits(s, 1)
            r.append(s, [1, 2, 3])
        elif kind == 3:
            r.logits(s, 1)
            r.truncate(s, 15)
        out.append(s)
    return out


def chain(r: CausalLMRunner, before: KVSession, tree: DraftTree, path: list[int]) -> tuple[torch.Tensor, KVSession]:
    """The path run as a chain after `before` (a copy): its len(path) + 1 logit rows, and its session."""
    s = r.fork(before)
    r.append(s, [tree.token_ids[i] for i in path])
    return r.logits(s, len(path) + 1), s


def assert_same_kv(a: KVSession, b: KVSession) -> None:
    assert a.cached == b.cached == len(a.tokens) and a.tokens == b.tokens
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.keys is not None and lb.keys is not None and la.values is not None and lb.values is not None
        assert la.keys.shape == lb.keys.shape
        diff = max((la.keys - lb.keys).abs().max().item(), (la.values - lb.values).abs().max().item())
        assert diff <= TOL, f"kept KV differs from the chain's by {diff:.3g}"


def check_against_chains(r: CausalLMRunner, sessions: list[KVSession], trees: list[DraftTree]) -> None:
    befores = [copy.deepcopy(s) for s in sessions]
    results = r.tree_logits_batch(sessions, trees)
    for b, (s, before, tree, res) in enumerate(zip(sessions, befores, trees, results)):
        assert res.logits.shape == (len(tree) + 1, r.vocab_size) and res.logits.dtype == torch.float32
        assert s.tokens == before.tokens and s.cached == len(s.tokens)  # the cache holds the tokens only
        assert {layer.get_seq_length() for layer in s.cache.layers} == {len(s.tokens)}
        for path in tree.paths() or [[]]:
            want, chained = chain(r, before, tree, path)
            got = res.logits[[0] + [1 + i for i in path]]
            diff = (got - want).abs().max().item()
            assert diff <= TOL, f"session {b}, path {path}: tree logits differ from the chain's by {diff:.3g}"
            kept = r.fork(s)
            r.keep_tree_path(kept, res, path)
            assert_same_kv(kept, chained)


def test_each_path_equals_its_chain_batched(runner: CausalLMRunner):
    rng = random.Random(1)
    sessions = sessions_in_states(runner, rng)
    trees = [random_tree(rng, 12, 256), DraftTree.chain([5, 6, 7]), random_tree(rng, 0, 256), random_tree(rng, 5, 256)]
    check_against_chains(runner, sessions, trees)


@pytest.mark.parametrize("state", [0, 1, 2, 3])
def test_each_path_equals_its_chain_alone(runner: CausalLMRunner, state: int):
    """One session runs on its own cache (no padded copy)."""
    rng = random.Random(10 + state)
    s = sessions_in_states(runner, rng)[state]
    check_against_chains(runner, [s], [random_tree(rng, 9, 256)])


def test_layout_mask_and_positions():
    tree = DraftTree.from_wire([7, 8, 9], [-1, -1, 0], [], 16)  # two siblings, a grandchild under node 0
    lay = tree_layout(
        [2, 0], [[1, 2], [3]], [tree, DraftTree.chain([])], dtype=torch.float32, device="cpu", max_position=99
    )
    assert lay.past == 2 and lay.tails == [2, 1] and lay.nodes == [3, 0]
    # session 0: past 2, tail rows at 2, 3 (committed 4), nodes at 4, 4, 5
    assert lay.position_ids[0].tolist() == [2, 3, 4, 4, 5]
    assert lay.input_ids[0].tolist() == [1, 2, 7, 8, 9]
    seen = lay.mask[0, 0] == 0  # [S, L + S]
    want = [
        [1, 1, 1, 0, 0, 0, 0],  # tail 0: past, itself
        [1, 1, 1, 1, 0, 0, 0],  # tail 1
        [1, 1, 1, 1, 1, 0, 0],  # node 0: past, tail, itself
        [1, 1, 1, 1, 0, 1, 0],  # node 1: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # node 2: its parent node 0
    ]
    assert seen.int().tolist() == want
    assert lay.rows[0].tolist() == [False, True, True, True, True]
    # session 1: nothing cached (left padding hidden), one tail row, then padding that sees itself only
    assert (lay.mask[1, 0] == 0).int().tolist()[0] == [0, 0, 1, 0, 0, 0, 0]
    assert (lay.mask[1, 0] == 0).int().tolist()[3] == [0, 0, 0, 0, 0, 1, 0]
    assert lay.rows[1].tolist() == [True, False, False, False, False]


def test_tree_speculation_at_temperature_zero_is_target_only_greedy(llama_runner: CausalLMRunner):
    """Rounds of tree verify + greedy verdict + keep_tree_path + the next token, three sessions batched,
    spell exactly what plain greedy decoding spells (trees mix the right token with wrong ones)."""
    r, rng, steps = llama_runner, random.Random(7), 24
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (6, 13, 3)]
    want = []
    for p in prompts:  # target-only greedy
        s = r.new_session(p)
        for _ in range(steps):
            r.append(s, [int(r.logits(s, 1)[-1].argmax())])
        want.append(s.tokens[len(p) :])
    sessions = [r.new_session(p) for p in prompts]
    rounds = 0
    while any(len(s.tokens) - len(p) < steps for s, p in zip(sessions, prompts)):
        trees = []
        for s, p, w in zip(sessions, prompts, want):
            done = len(s.tokens) - len(p)
            trees.append(oracle_tree(rng, w[done:], 256))
        for s, tree, res in zip(sessions, trees, r.tree_logits_batch(sessions, trees)):
            v = tree_greedy_verdict(res.logits, tree)
            assert v is not None
            r.keep_tree_path(s, res, list(v.accepted))
            r.append(s, [v.next_token])
        rounds += 1
    for s, p, w in zip(sessions, prompts, want):
        assert s.tokens[len(p) : len(p) + steps] == w
    assert rounds < steps  # the trees did keep more than one token a round


def oracle_tree(rng: random.Random, truth: list[int], vocab: int) -> DraftTree:
    """A depth-4 tree of up to 2 children a node: each child the true next token with probability 0.6."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(-1, 0)]  # (node, depth): the true path is followed while a child guesses right
    while frontier:
        node, depth = frontier.pop(0)
        if depth >= 4 or depth >= len(truth):
            continue
        for _ in range(2):
            right = rng.random() < 0.6
            tokens.append(truth[depth] if right else rng.randrange(vocab))
            parents.append(node)
            if tokens[-1] == truth[depth]:
                frontier.append((len(tokens) - 1, depth + 1))
    return DraftTree.from_wire(tokens, parents, [], vocab)


def test_refusals_and_a_session_edited_since_its_pass(llama_runner: CausalLMRunner):
    r = llama_runner
    s = r.new_session([1, 2, 3])
    tree = DraftTree.from_wire([4, 5], [-1, 0], [], 256)
    with pytest.raises(InvalidArgument, match="more than once"):
        r.tree_logits_batch([s, s], [tree, tree])
    with pytest.raises(InvalidArgument, match="one tree per session"):
        r.tree_logits_batch([s], [])
    deep = DraftTree.chain([7] * (r.max_context - 2))
    with pytest.raises(InvalidArgument, match="exceed the context"):
        r.tree_logits_batch([s], [deep])
    (res,) = r.tree_logits_batch([s], [tree])
    with pytest.raises(InvalidArgument, match="not a path"):
        r.keep_tree_path(s, res, [1])
    edited = r.fork(s)
    r.append(edited, [9])
    with pytest.raises(InvalidArgument, match="verify the tree again"):
        r.keep_tree_path(edited, res, [0])
    # a rollback of the cache since the pass: tokens appended, the cache refills on the next forward
    behind = r.fork(s)
    r._crop(behind, 1)
    r.keep_tree_path(behind, res, [0, 1])
    assert behind.tokens == [1, 2, 3, 4, 5] and behind.cached == 1
    assert (r.logits(behind, 1) - res.logits[2]).abs().max().item() <= TOL


def test_failed_forward_leaves_sessions_usable(llama_runner: CausalLMRunner, monkeypatch: pytest.MonkeyPatch):
    r = llama_runner
    a, b = r.new_session([1, 2, 3, 4]), r.new_session([5, 6])
    r.logits(a, 1)
    want = r.logits(r.fork(a), 1)

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(r.model, "forward", boom)
    with pytest.raises(RuntimeError):
        r.tree_logits_batch([a, b], [DraftTree.chain([1]), DraftTree.chain([2])])
    monkeypatch.undo()
    assert a.cached <= len(a.tokens) - 1 and b.cached == 0
    assert (r.logits(a, 1) - want).abs().max().item() <= TOL
