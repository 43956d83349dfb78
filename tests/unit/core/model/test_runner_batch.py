"""CausalLMRunner.logits_batch: one forward for many sessions, same results and caches as one forward each."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from target_service.workers.tp_runner import TensorParallelRunner
from tests.devices import DEVICE

# Max abs difference allowed between batched and per-session logits (|logits| < ~7
# on the tiny models). Padding changes the float32 reduction order inside
# attention (~1 ulp there), which the tiny random Llama amplifies: over 40
# random batches per model the difference had median 5e-6 and max 1.05e-5
# (GPT-2: 3e-6 / 5e-6), the same noise as cached-vs-full in test_runner.py
# (max 9e-6 on the same batches). 1e-5 would sit inside that noise.
TOL = 2e-5


@pytest.fixture(scope="module", params=["llama", "gpt2", "llama-eager", "gpt2-eager"])
def runner(request: pytest.FixtureRequest, tiny_pair: tuple[Path, Path], tiny_gpt2_dir: Path) -> CausalLMRunner:
    """Both architectures, with SDPA (the default) and eager attention: each builds its own 4D mask.

    On SPECD_TEST_DEVICE (the tests marked `device` use it there)."""
    path = tiny_pair[0] if request.param.startswith("llama") else tiny_gpt2_dir
    model = load_pretrained(path).model.to(DEVICE)
    if request.param.endswith("eager"):
        model.set_attn_implementation("eager")
    return CausalLMRunner(model)


@pytest.fixture(scope="module")
def llama_runner(tiny_pair: tuple[Path, Path]) -> CausalLMRunner:
    return CausalLMRunner(load_pretrained(tiny_pair[0]).model)


def random_ids(rng: random.Random, r: CausalLMRunner, n: int) -> list[int]:
    return [rng.randrange(r.vocab_size) for _ in range(n)]


def assert_consistent(s: KVSession) -> None:
    """The runner invariant after a forward: every layer caches exactly all tokens."""
    assert s.cached == len(s.tokens)
    assert {layer.get_seq_length() for layer in s.cache.layers} == {len(s.tokens)}


def batch_vs_single(r: CausalLMRunner, sessions: list[KVSession], num_last: list[int]) -> list[KVSession]:
    """logits_batch on `sessions` equals logits on deep copies; returns the copies (advanced alike)."""
    copies = [copy.deepcopy(s) for s in sessions]
    got = r.logits_batch(sessions, num_last)
    want = [r.logits(c, k) for c, k in zip(copies, num_last)]
    assert len(got) == len(sessions)
    for b, (g, w, k) in enumerate(zip(got, want, num_last)):
        assert g.shape == (k, r.vocab_size) and g.dtype == torch.float32
        diff = (g - w).abs().max().item()
        assert diff <= TOL, f"session {b} (len {len(sessions[b].tokens)}): batched logits differ by {diff:.3g}"
    for s, c in zip(sessions, copies):
        assert s.tokens == c.tokens
        assert_consistent(s)
    return copies


def mixed_sessions(r: CausalLMRunner, rng: random.Random, count: int) -> list[KVSession]:
    """Sessions of different lengths: uncached, fully cached, partly cached, rolled back."""
    sessions = []
    for i in range(count):
        s = r.new_session(random_ids(rng, r, rng.randint(1, 40)))
        kind = i % 4
        if kind >= 1:
            r.logits(s)  # fully cached
        if kind == 2:
            r.append(s, random_ids(rng, r, rng.randint(1, 6)))  # partly cached
        if kind == 3:
            r.truncate(s, rng.randint(1, len(s.tokens)))  # rolled back (cache cropped)
            r.append(s, random_ids(rng, r, rng.randint(0, 3)))
        sessions.append(s)
    rng.shuffle(sessions)
    return sessions


# ---- results and caches ----------------------------------------------------------------


@pytest.mark.device
def test_batch_matches_per_session_logits(runner: CausalLMRunner) -> None:
    r = runner
    for seed in range(3):
        rng = random.Random(seed)
        sessions = mixed_sessions(r, rng, 7)
        num_last = [rng.randint(1, min(6, len(s.tokens))) for s in sessions]
        copies = batch_vs_single(r, sessions, num_last)
        # The written-back caches carry on: a decode step per session still matches.
        for s, c in zip(sessions, copies):
            t = rng.randrange(r.vocab_size)
            r.append(s, [t])
            r.append(c, [t])
        batch_vs_single(r, sessions, [1] * len(sessions))
        for s, c in zip(sessions, copies):
            diff = (r.logits(s, 2) - r.logits(c, 2)).abs().max().item()
            assert diff <= TOL


@pytest.mark.device
def test_batched_verify_walk(runner: CausalLMRunner) -> None:
    """Rounds of speculative verification, batched, against the same rounds unbatched."""
    r = runner
    rng = random.Random(10)
    sessions = mixed_sessions(r, rng, 5)
    r.logits_batch(sessions, [1] * len(sessions))  # prefill
    singles = [copy.deepcopy(s) for s in sessions]
    for _ in range(6):
        ks = [rng.randint(0, 5) for _ in sessions]  # a session may draft 0 tokens (plain decode)
        for s, c, k in zip(sessions, singles, ks):
            drafts = random_ids(rng, r, k)
            r.append(s, drafts)
            r.append(c, drafts)
        got = r.logits_batch(sessions, [k + 1 for k in ks])
        want = [r.logits(c, k + 1) for c, k in zip(singles, ks)]
        for s, c, g, w, k in zip(sessions, singles, got, want, ks):
            assert (g - w).abs().max().item() <= TOL
            assert_consistent(s)
            # accept a random prefix of the drafts, then the recovered/bonus token
            accepted = rng.randint(0, k)
            keep = len(s.tokens) - k + accepted
            bonus = int(g[accepted].argmax())
            for x in (s, c):
                r.truncate(x, keep)
                r.append(x, [bonus])
    for s, c in zip(sessions, singles):
        assert s.tokens == c.tokens
        assert (r.logits(s, 3) - r.logits(c, 3)).abs().max().item() <= TOL


@pytest.mark.device
def test_near_max_context(runner: CausalLMRunner) -> None:
    """A full-context session next to one with many new tokens: padded positions run past the table."""
    r = runner
    rng = random.Random(20)
    full = r.new_session(random_ids(rng, r, r.max_context - 1))
    r.logits(full)
    r.append(full, random_ids(rng, r, 1))  # exactly max_context tokens, one uncached
    short = r.new_session(random_ids(rng, r, 30))  # 30 new tokens: padded rows of `full` reach max_context + 28
    mid = r.new_session(random_ids(rng, r, r.max_context - 10))
    r.logits(mid)
    r.truncate(mid, r.max_context - 20)
    r.append(mid, random_ids(rng, r, 19))
    batch_vs_single(r, [full, short, mid], [2, 30, 5])
    assert len(full.tokens) == r.max_context


def test_one_forward_for_the_batch(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    seen: list[tuple[tuple[int, ...], bool]] = []  # (input_ids shape, attention mask given) per forward

    def spy(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask") is not None))

    a = r.new_session(list(range(10)))
    b = r.new_session(list(range(20, 23)))
    r.logits(b)
    r.append(b, [1, 2])
    c = r.new_session([7])
    handle = r.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        r.logits_batch([a, b, c], [1, 3, 1])  # new tokens: 10, 3 (one recomputed), 1
        r.logits_batch([a], [2])  # a single session: the plain path, no padding
        assert r.logits_batch([], []) == []
    finally:
        handle.remove()
    assert seen == [((3, 10), True), ((1, 2), False)]


# ---- failures and validation ------------------------------------------------------------


def test_failed_forward_crops_every_session(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    rng = random.Random(30)
    sessions = mixed_sessions(r, rng, 4)
    for s in sessions:
        r.append(s, random_ids(rng, r, 2))
    num_last = [3] * len(sessions)
    starts = [min(s.cached, len(s.tokens) - 3) for s in sessions]

    def boom(*_: object) -> None:
        raise RuntimeError("injected failure in layer 2")

    handle = r.model.model.layers[2].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            r.logits_batch(sessions, num_last)
    finally:
        handle.remove()
    for s, start in zip(sessions, starts):
        assert s.cached == start
        assert all(layer.get_seq_length() == start for layer in s.cache.layers)
    batch_vs_single(r, sessions, num_last)  # usable afterwards


def test_validation_changes_nothing(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    a = r.new_session([1, 2, 3, 4])
    r.logits(a)
    r.append(a, [5])
    b = r.new_session([6, 7])
    before = [(s.tokens[:], s.cached) for s in (a, b)]
    cases = [
        (([a, b], [1, 3]), r"num_last must be an int in \[1, 2\] \(the sequence length\), got 3 \(sessions\[1\]\)"),
        (([a, b], [0, 1]), r"num_last must be an int in \[1, 5\]"),
        (([a, b], [1, True]), "got True"),
        (([a, b], [1.0, 1]), "got 1.0"),
        (([a, b], [1]), "got 2 sessions but 1 num_last values"),
        (([a, b], 1), "num_last must be a sequence of ints"),
        (([a, b, a], [1, 1, 1]), r"sessions\[2\] appears more than once"),
    ]
    for (sessions, num_last), match in cases:
        with pytest.raises(InvalidArgument, match=match):
            r.logits_batch(sessions, num_last)
        assert [(s.tokens, s.cached) for s in (a, b)] == before


# ---- the tensor-parallel runner falls back to one forward per session ------------------------


class _FakeGroup:
    """Just enough of a WorkerGroup to record what rank 0 would send its followers."""

    generation = 0

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        yield

    def send(self, command: tuple) -> None:
        self.sent.append(command)


def test_tensor_parallel_runner_sends_one_batch_command(
    tiny_pair: tuple[Path, Path], llama_runner: CausalLMRunner
) -> None:
    group = _FakeGroup()
    tp = TensorParallelRunner(llama_runner.model, group)  # type: ignore[arg-type]
    a, b = tp.new_session([1, 2, 3]), tp.new_session([4, 5])
    with pytest.raises(InvalidArgument, match="appears more than once"):
        tp.logits_batch([a, a], [1, 1])
    assert group.sent == []
    got = tp.logits_batch([a, b], [2, 1])
    # one command for the whole batch: (session, start, new tokens, rows) in order
    assert group.sent == [("forward_batch", [(a.tp_id, 0, [1, 2, 3], 2), (b.tp_id, 0, [4, 5], 1)])]
    want: list[Tensor] = [llama_runner.logits(llama_runner.new_session(t), k) for t, k in (([1, 2, 3], 2), ([4, 5], 1))]
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= TOL
