"""Out of memory in a shared forward pass: the batch is split and retried, and only the session that cannot fit fails.

The fault is injected into a real model's forward (a forward pre-hook of a
real runner's model, like tests/faults.py corrupts a real drafter): the pass
raises the allocator's error when it holds too many rows, or when it holds
the oversized session's prompt. The other sessions must come out exactly as
when run alone; the oversized one gets ResourceExhausted; an error that is
not about memory still fails the whole pass, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import ResourceExhausted
from specd.core.model.loading import load_pretrained
from specd.core.model.pool import is_out_of_memory
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest, VerifyOutcome, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

HUGE = 200  # a byte no ordinary prompt holds: the oversized session's prompt carries it
PROMPTS = ["hello world", "def f(x):\n    return", "abcabcabcabc", "The end. Fin.", "0123456789", "a longer one"]
PARAMS = [
    SamplingParams(temperature=0.0, seed=1),
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(temperature=0.0, seed=4),
    SamplingParams(temperature=0.5, top_k=20, seed=5),
    SamplingParams(temperature=0.0, seed=6),
]

OOM_ERRORS: list[Callable[[], BaseException]] = [
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: MemoryError(),
    lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 1 bytes"),
]


class OutOfMemoryRunner(CausalLMRunner):
    """A real runner whose model's forward fails to allocate when `too_big(input_ids)` says so.

    Records the rows of every forward it was asked to run (`passes`) and how many it refused (`refused`).
    """

    def __init__(self, model: PreTrainedModel, error: Callable[[], BaseException]) -> None:
        super().__init__(model)
        self.error = error
        self.too_big: Callable[[torch.Tensor], bool] = lambda ids: False
        self.passes: list[int] = []
        self.refused = 0
        self._hook = model.register_forward_pre_hook(self._allocate, with_kwargs=True)

    def _allocate(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]  # [B, S]: the rows this pass runs
        self.passes.append(int(ids.shape[0]))
        if self.too_big(ids):
            self.refused += 1
            raise self.error()

    def remove(self) -> None:
        self._hook.remove()


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    ids = [t.tokenizer(p).input_ids for p in PROMPTS]
    assert all(HUGE not in p for p in ids)
    return t.model, d.model, ids


@pytest.fixture(params=range(len(OOM_ERRORS)), ids=["torch.OutOfMemoryError", "MemoryError", "cpu-allocator"])
def error(request: pytest.FixtureRequest) -> Callable[[], BaseException]:
    return OOM_ERRORS[request.param]


def _runner(model: PreTrainedModel, error: Callable[[], BaseException]) -> Iterator[OutOfMemoryRunner]:
    runner = OutOfMemoryRunner(model, error)
    try:
        yield runner
    finally:
        runner.remove()


@pytest.fixture
def target_runner(models, error) -> Iterator[OutOfMemoryRunner]:
    yield from _runner(models[0], error)


@pytest.fixture
def draft_runner(models, error) -> Iterator[OutOfMemoryRunner]:
    yield from _runner(models[1], error)


def _more_than(rows: int) -> Callable[[torch.Tensor], bool]:
    """Memory for `rows` rows a pass, and never for the oversized session's prompt."""
    return lambda ids: ids.shape[0] > rows or bool((ids == HUGE).any())


def test_the_kinds_of_out_of_memory() -> None:
    assert all(is_out_of_memory(make()) for make in OOM_ERRORS)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the allocator's kinds


# ---- the verifier ----------------------------------------------------------------------------------


def _drafts(prompt: list[int], i: int) -> Proposal:
    return Proposal([(prompt[-1] + 3 * j + i) % 190 for j in range(1 + i % 3)])


def _verify_two_rounds(
    v: Verifier, names: list[str], prompts: list[list[int]], keys: list[int]
) -> list[list[VerifyOutcome | Exception]]:
    """Two batched verifies (the first prefills every prompt): per round, per session, outcome or error.

    keys: per session, what its drafts are made of (the same alone and in the batch)."""
    committed = [len(p) for p in prompts]
    rounds = []
    for r in range(2):
        reqs = [VerifyRequest(n, c, _drafts(p, key + r)) for n, c, p, key in zip(names, committed, prompts, keys)]
        results = v.verify_batch(reqs)
        committed = [
            res.committed_length if isinstance(res, VerifyOutcome) else c for res, c in zip(results, committed)
        ]
        rounds.append(results)
    return rounds


def test_out_of_memory_in_a_verify_batch_splits_it_and_fails_only_the_oversized_session(
    models, target_runner: OutOfMemoryRunner, error: Callable[[], BaseException]
) -> None:
    _, _, ids = models
    want = []
    for i, (p, sp) in enumerate(zip(ids, PARAMS)):  # each alone, with all the memory it wants
        alone = Verifier(target_runner)
        alone.open("alone", p, sp)
        want.append([r[0] for r in _verify_two_rounds(alone, ["alone"], [p], [i])])

    v = Verifier(target_runner)
    names = [f"s{i}" for i in range(len(ids))]
    for n, p, sp in zip(names, ids, PARAMS):
        v.open(n, p, sp)
    oversized = [*ids[2], HUGE]
    v.open("oversized", oversized, SamplingParams(temperature=0.7, seed=9))
    target_runner.too_big, target_runner.passes = _more_than(2), []
    order = names[:3] + ["oversized"] + names[3:]
    rounds = _verify_two_rounds(v, order, ids[:3] + [oversized] + ids[3:], [0, 1, 2, 7, 3, 4, 5])

    assert target_runner.refused > 0 and max(target_runner.passes) == len(order)  # the whole batch was tried first
    for r, results in enumerate(rounds):
        got = results[:3] + results[4:]
        for i, (res, expect) in enumerate(zip(got, [w[r] for w in want])):
            assert isinstance(res, VerifyOutcome), (r, i, res)
            assert isinstance(expect, VerifyOutcome)
            assert (res.accepted, res.token_id, res.is_bonus, res.committed_length) == (
                expect.accepted,
                expect.token_id,
                expect.is_bonus,
                expect.committed_length,
            )
            assert 1 <= res.phases.batch_size <= 2
        shed = results[3]
        assert isinstance(shed, ResourceExhausted), shed
        assert str(shed).startswith("out of memory for this request") and "retry" in str(shed)
        assert v._pool.get("oversized").kv.tokens == oversized  # rolled back to its committed prefix
    assert any(res.phases.batch_size == 2 for res in rounds[0] if isinstance(res, VerifyOutcome))  # still batched


def test_an_error_that_is_not_out_of_memory_still_fails_the_whole_pass(models) -> None:
    _, _, ids = models
    runner = OutOfMemoryRunner(models[0], lambda: RuntimeError("a kernel failed"))
    try:
        v = Verifier(runner)
        for i, p in enumerate(ids[:4]):
            v.open(f"s{i}", p, PARAMS[0])
        runner.too_big = _more_than(2)
        results = v.verify_batch([VerifyRequest(f"s{i}", len(p), _drafts(p, i)) for i, p in enumerate(ids[:4])])
        assert all(isinstance(r, RuntimeError) and str(r) == "a kernel failed" for r in results), results
        assert runner.passes == [4]  # no split, no retry
        assert [v._pool.get(f"s{i}").kv.tokens for i in range(4)] == ids[:4]
    finally:
        runner.remove()


# ---- the model drafter -------------------------------------------------------------------------------


def test_out_of_memory_in_a_draft_batch_splits_it_and_fails_only_the_oversized_session(
    models, draft_runner: OutOfMemoryRunner
) -> None:
    _, _, ids = models
    k = 4
    want = []
    for p, sp in zip(ids, PARAMS):
        alone = ModelDrafter(draft_runner, wire_top_k=4)
        alone.open("alone", p, sp)
        want.append(alone.propose(ProposeRequest("alone", len(p), len(p), [], k)))

    d = ModelDrafter(draft_runner, wire_top_k=4)
    names = [f"s{i}" for i in range(len(ids))]
    for n, p, sp in zip(names, ids, PARAMS):
        d.open(n, p, sp)
    oversized = [*ids[0], HUGE]
    d.open("oversized", oversized, SamplingParams(temperature=0.0, seed=9))
    # Prefills fit any batch; a decode step holds at most 2 rows; the oversized prompt never fits. So a
    # group drafts a token or more before it runs out: the retry starts from the tokens its checks left.
    draft_runner.too_big = lambda ids: (ids.shape[1] == 1 and ids.shape[0] > 2) or bool((ids == HUGE).any())
    draft_runner.passes = []
    reqs = [ProposeRequest(n, len(p), len(p), [], k) for n, p in zip(names, ids)]
    results = d.propose_batch(
        reqs[:2] + [ProposeRequest("oversized", len(oversized), len(oversized), [], k)] + reqs[2:]
    )

    assert draft_runner.refused > 0
    got = results[:2] + results[3:]
    for res, expect in zip(got, want):
        assert isinstance(res, Proposal), res
        assert res.token_ids == expect.token_ids
        if res.q_ids is not None or expect.q_ids is not None:
            assert res.q_ids is not None and expect.q_ids is not None and torch.equal(res.q_ids, expect.q_ids)
        # q's integer weights: a batched forward may move one by a grid step (the tokens do not move)
        if res.q_probs is not None or expect.q_probs is not None:
            assert res.q_probs is not None and expect.q_probs is not None
            assert bool(((res.q_probs - expect.q_probs).abs() <= 1).all())
    for n, p, res in zip(names, ids, got):
        assert isinstance(res, Proposal) and d._pool.get(n).kv.tokens == p + res.token_ids  # drafted once, not twice
    shed = results[2]
    assert isinstance(shed, ResourceExhausted) and str(shed).startswith("out of memory for this request"), shed
    assert d._pool.get("oversized").kv.tokens == oversized
