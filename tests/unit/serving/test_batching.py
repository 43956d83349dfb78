"""Batched verification and drafting in-process: the same tokens as one session at a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.errors import SessionNotFound
from specd.core.inprocess import speculative_generate, speculative_generate_batch
from specd.core.model.loading import load_pretrained
from specd.core.model.pool import KVBudget
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest, VerifyOutcome, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.serving.batching import FRUITLESS_RUN, FRUITLESS_SKIP, MicroBatcher
from specd.serving.streams import Stamped
from specd.v1 import common_pb2, session_pb2, target_pb2
from target_service.servicer import TargetServicer

PROMPTS = ["hello world", "def f(x):\n    return", "abcabcabc", "The end.", "x", "a much longer prompt " * 6]


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    return t, d


def _batched_generate(
    prompts: list[list[int]],
    verifier: Verifier,
    drafter: ModelDrafter | NgramDrafter | None,
    params: list[SamplingParams],
    ks: list[int],
    max_new_tokens: int,
) -> list[list[int]]:
    results = speculative_generate_batch(
        prompts, verifier, drafter, params, draft_lengths=ks, max_new_tokens=max_new_tokens
    )
    return [r.token_ids for r in results]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_rounds_equal_one_session_at_a_time(tiny, temperature: float) -> None:
    t, d = tiny
    verifier, drafter = Verifier(CausalLMRunner(t.model)), ModelDrafter(CausalLMRunner(d.model), wire_top_k=4)
    prompts = [t.tokenizer(p).input_ids for p in PROMPTS]
    params = [
        SamplingParams(temperature=temperature, top_p=0.95 if i % 2 else 1.0, seed=100 + i) for i in range(len(prompts))
    ]
    ks = [1, 2, 3, 4, 5, 8]  # different K per session: the batch pads drafts and q
    want = [
        speculative_generate(p, verifier, drafter, sp, draft_length=k, max_new_tokens=24).token_ids
        for p, sp, k in zip(prompts, params, ks)
    ]
    got = _batched_generate(prompts, verifier, drafter, params, ks, 24)
    assert got == want


def test_batched_target_only_and_ngram_equal_unbatched(tiny) -> None:
    t, _ = tiny
    verifier = Verifier(CausalLMRunner(t.model))
    prompts = [t.tokenizer(p).input_ids for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, seed=i) for i in range(len(prompts))]
    want = [
        speculative_generate(p, verifier, None, sp, draft_length=0, max_new_tokens=20).token_ids
        for p, sp in zip(prompts, params)
    ]
    assert _batched_generate(prompts, verifier, None, params, [0] * len(prompts), 20) == want
    ngram = NgramDrafter(verifier.vocab_size)
    assert _batched_generate(prompts, verifier, ngram, params, [4] * len(prompts), 20) == want


def test_one_bad_request_leaves_the_batch_alone(tiny) -> None:
    t, d = tiny
    verifier, drafter = Verifier(CausalLMRunner(t.model)), ModelDrafter(CausalLMRunner(d.model))
    greedy = SamplingParams(temperature=0.0, seed=0)
    a, b = t.tokenizer("first one").input_ids, t.tokenizer("second").input_ids
    for sid, p in (("a", a), ("b", b)):
        verifier.open(sid, p, greedy)
        drafter.open(sid, p, greedy)
    props = drafter.propose_batch(
        [
            ProposeRequest("a", len(a), len(a), [], 3),
            ProposeRequest("nope", 3, 3, [], 3),
            ProposeRequest("b", len(b), len(b), [], 2),
        ]
    )
    assert isinstance(props[1], SessionNotFound)
    assert [len(props[0]), len(props[2])] == [3, 2]
    assert props[0].phases.batch_size == 2 and props[0].phases.total_ms("forward") > 0
    outs = verifier.verify_batch(
        [
            VerifyRequest("a", len(a), props[0]),
            VerifyRequest("b", len(b) + 5, props[2]),  # wrong committed length: out of sync, alone
            VerifyRequest("a", len(a), props[0]),  # the same session twice in one batch
        ]
    )
    assert isinstance(outs[0], VerifyOutcome) and outs[0].phases.batch_size == 1
    assert not isinstance(outs[1], VerifyOutcome) and not isinstance(outs[2], VerifyOutcome)
    names = [p.name for p in outs[0].phases.phases]
    assert names == ["sync", "forward", "sampling", "rollback"]
    # "b" is untouched by its failed message: a correct verify still works
    assert isinstance(verifier.verify_batch([VerifyRequest("b", len(b), props[2])])[0], VerifyOutcome)


def test_forward_groups_respect_max_batch_and_the_kv_budget() -> None:
    free = KVBudget(0, lambda: 100)
    assert free.forward_groups([5, 1, 3, 2], 2) == [[1, 3], [2, 0]]  # shortest first, two per pass
    tight = KVBudget(100 * 10, lambda: 100)  # room for 10 token positions
    groups = tight.forward_groups([4, 4, 4, 9], 32)
    assert groups == [[0, 1], [2], [3]]  # 2 x 4 <= 10; adding a third would pad to 12
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    # A prompt's prefill (300 new positions) does not pad four 5-token verifies to 300 each.
    groups = free.forward_groups([400, 120, 130, 140, 150], 32, new_tokens=[300, 5, 5, 5, 5])
    assert groups == [[1, 2, 3, 4], [0]]
    assert free.forward_groups([10, 20], 32, new_tokens=[5, 26]) == [[0, 1]]  # 26 <= 2 x 5 + 16: together
    assert free.forward_groups([10, 20], 32, new_tokens=[5, 27]) == [[0], [1]]


def test_micro_batcher_batches_what_waits_in_order() -> None:
    seen: list[list[int]] = []
    gate = threading.Event()

    def handle(batch: list[int]) -> list[int]:
        if not seen:
            gate.wait(5)  # hold the first batch so the rest queue up
        seen.append(list(batch))
        return [x * 10 for x in batch]

    with ThreadPoolExecutor(max_workers=1) as pool:
        batcher: MicroBatcher[int, int] = MicroBatcher(handle, pool, max_batch=3)
        first = batcher.submit_one(0)
        time.sleep(0.05)
        futures = [batcher.submit_one(i) for i in range(1, 6)]
        gate.set()
        assert first.result(5) == 0
        assert [f.result(5) for f in futures] == [10, 20, 30, 40, 50]
    assert seen == [[0], [1, 2, 3], [4, 5]]


def test_micro_batcher_runs_idle_work_between_batches_and_requests_wait_only_for_one_call() -> None:
    """With the queue empty the model thread calls idle() while it has work; a request arriving meanwhile
    runs right after the call under way; a failing idle() is logged and serving goes on."""
    events: list[str] = []
    left = [3]  # idle calls with work before it has none
    in_idle = threading.Event()
    release = threading.Event()

    def idle() -> bool:
        events.append("idle")
        if left[0] == 3:
            in_idle.set()
            release.wait(5)  # a request arrives during this call
        left[0] -= 1
        if left[0] < 0:
            raise RuntimeError("idle broke")
        return left[0] > 0

    def handle(batch: list[int]) -> list[int]:
        events.append(f"batch {batch}")
        return [x * 10 for x in batch]

    with ThreadPoolExecutor(max_workers=1) as pool:
        batcher: MicroBatcher[int, int] = MicroBatcher(handle, pool, idle=idle)
        assert batcher.submit_one(1).result(5) == 10
        assert in_idle.wait(5)
        second = batcher.submit_one(2)
        release.set()
        assert second.result(5) == 20
        pool.submit(lambda: None).result(5)  # the drain has finished
        assert batcher.submit_one(3).result(5) == 30
        pool.submit(lambda: None).result(5)
    # after batch [1]: the first idle call (holding [2] up), then [2], then idle until it has none;
    # after [3]: idle() raises, which ends that drain (logged)
    assert events == ["batch [1]", "idle", "batch [2]", "idle", "idle", "batch [3]", "idle"]


def test_micro_batcher_fails_every_request_of_a_failed_batch() -> None:
    def handle(batch: list[int]) -> list[int]:
        raise RuntimeError("model thread fell over")

    with ThreadPoolExecutor(max_workers=1) as pool:
        batcher: MicroBatcher[int, int] = MicroBatcher(handle, pool)
        f = batcher.submit_one(1)
        with pytest.raises(RuntimeError, match="fell over"):
            f.result(5)
        assert batcher.submit_one(2).exception(5) is not None  # and it keeps taking requests


def test_micro_batcher_withdraws_queued_requests_unrun() -> None:
    seen: list[int] = []
    gate = threading.Event()

    def handle(batch: list[int]) -> list[int]:
        gate.wait(5)
        seen.extend(batch)
        return [x * 10 for x in batch]

    with ThreadPoolExecutor(max_workers=1) as pool:
        batcher: MicroBatcher[int, int] = MicroBatcher(handle, pool, max_batch=8)
        running = batcher.submit_one(0)
        time.sleep(0.05)  # 0 is in a batch now: not withdrawable
        queued = [batcher.submit_one(i) for i in range(1, 6)]
        assert batcher.withdraw(lambda x: x % 2 == 0 or x == 0, lambda x: -x) == 2  # 2 and 4
        assert queued[1].result(0) == -2 and queued[3].result(0) == -4  # answered at once, unrun
        gate.set()
        assert running.result(5) == 0 and [queued[i].result(5) for i in (0, 2, 4)] == [10, 30, 50]
    assert seen == [0, 1, 3, 5]


def test_a_close_withdraws_its_sessions_queued_messages(tiny) -> None:
    """The coordinator closes an abandoned request's sessions: their queued open and verify never run."""
    t, _ = tiny
    verifier = Verifier(CausalLMRunner(t.model))
    prompt = t.tokenizer("abandoned " * 20).input_ids
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = TargetServicer(verifier, pool, common_pb2.ModelInfo())
        pool.submit(gate.wait, 5)  # the model thread is busy: what follows queues

        def message(sid: str, op: str) -> Stamped[target_pb2.TargetRequest]:
            req = target_pb2.TargetRequest(session_id=sid, committed_length=len(prompt))
            if op == "open":
                req.open.token_ids.extend(prompt)
                req.open.sampling.seed = 1
            elif op == "verify":
                req.verify.start = len(prompt)
            else:
                req.close.SetInParent()
            return Stamped(req, time.perf_counter_ns())

        sent = [message(*m) for m in (("a", "open"), ("b", "open"), ("a", "verify"), ("a", "close"))]
        answers: dict[int, Future[target_pb2.TargetResponse]] = {id(s): Future() for s in sent}

        def deliver(answered: list[tuple[Stamped[target_pb2.TargetRequest], Any]]) -> None:
            for stamped, resp in answered:
                answers[id(stamped)].set_result(resp)

        for s in sent[:3]:
            servicer._submit([s], deliver)  # three stream messages ...
        servicer._submit([sent[3]], deliver)  # ... then the close
        futures = [answers[id(s)] for s in sent]
        # a's open and verify: answered before the model thread is free, and not run
        for f in (futures[0], futures[2]):
            resp = f.result(0)
            assert (
                resp.error.code == session_pb2.SessionError.CODE_SESSION_NOT_FOUND and "not run" in resp.error.message
            )
        # a batch the model thread took before the close came: its messages of a are skipped there
        taken = servicer.handle_batch([message("a", "open").request, message("b", "verify").request])
        assert taken[0].error.code == session_pb2.SessionError.CODE_SESSION_NOT_FOUND
        assert taken[1].WhichOneof("result") == "error"  # b is not open yet: its own error, it ran
        gate.set()
        assert futures[1].result(10).WhichOneof("result") == "ack"
        assert futures[3].result(10).WhichOneof("result") == "ack"  # closing a session never opened is fine
    assert verifier.active_sessions() == 1  # only b ever opened


def test_verify_batch_is_one_forward(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    t, _ = tiny
    runner = CausalLMRunner(t.model)
    verifier = Verifier(runner)
    calls: list[int] = []
    real = runner.logits_batch
    monkeypatch.setattr(runner, "logits_batch", lambda ss, nl, **kw: calls.append(len(ss)) or real(ss, nl, **kw))
    greedy = SamplingParams(temperature=0.0, seed=0)
    reqs = []
    for i, text in enumerate(PROMPTS):
        p = t.tokenizer(text).input_ids
        verifier.open(f"s{i}", p, greedy)
        reqs.append(VerifyRequest(f"s{i}", len(p), Proposal([])))
    first = verifier.verify_batch(reqs)  # prefills of different lengths: grouped by new tokens
    assert len(calls) > 1 and sum(calls) == len(PROMPTS)
    calls.clear()
    reqs = [VerifyRequest(f"s{i}", o.committed_length, Proposal([1, 2][: i % 3])) for i, o in enumerate(first)]
    outs = verifier.verify_batch(reqs)  # then K+1-token verifies: one pass for all
    assert all(isinstance(o, VerifyOutcome) for o in outs)
    assert calls == [len(PROMPTS)]
    assert torch.tensor([o.phases.batch_size for o in outs]).eq(len(PROMPTS)).all()


def test_servicer_batch_walk_keeps_session_order_and_turns_failures_into_in_band_errors(tiny) -> None:
    t, _ = tiny
    verifier = Verifier(CausalLMRunner(t.model))
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = TargetServicer(verifier, pool, common_pb2.ModelInfo())
        prompt = t.tokenizer("walk").input_ids

        def open_(sid: str) -> target_pb2.TargetRequest:
            req = target_pb2.TargetRequest(session_id=sid, committed_length=len(prompt))
            req.open.token_ids.extend(prompt)
            req.open.sampling.seed = 1
            return req

        def verify(sid: str) -> target_pb2.TargetRequest:
            req = target_pb2.TargetRequest(session_id=sid, committed_length=len(prompt))
            req.verify.start = len(prompt)
            return req

        close = target_pb2.TargetRequest(session_id="a")
        close.close.SetInParent()
        # open a, open b, verify a, verify b, close a: the verifies share one pass, close a runs after it
        out = servicer.handle_batch([open_("a"), open_("b"), verify("a"), verify("b"), close])
        assert [r.WhichOneof("result") for r in out] == ["ack", "ack", "verdict", "verdict", "ack"]
        assert out[2].verdict.batch_size == 2 and out[2].verdict.batch_tokens == 2 * len(prompt)

        # a bug below the batch walk becomes an in-band INTERNAL error, not a broken stream
        def broken(requests, **_):
            raise RuntimeError("boom")

        verifier.verify_batch = broken  # type: ignore[method-assign]
        out = servicer.handle_batch([verify("b")])
        assert out[0].error.code == session_pb2.SessionError.CODE_INTERNAL and "boom" not in out[0].error.message


def test_a_deferred_bonus_splits_one_round_into_two_with_the_same_tokens(tiny) -> None:
    """Post-verify: round x with the bonus deferred, then round y == one round over x + y (same coins, same
    verdict); with no y, the next round draws exactly the bonus the deferred round did not."""
    t, _ = tiny
    target_runner = CausalLMRunner(t.model)
    drafter = ModelDrafter(CausalLMRunner(t.model), wire_top_k=8)  # the target drafts for itself: q close to p
    split, single = Verifier(target_runner), Verifier(CausalLMRunner(t.model))
    prompt = t.tokenizer("defer the bonus").input_ids
    n, deferred_seen = len(prompt), 0
    for seed in range(24):
        params = SamplingParams(temperature=0.0 if seed < 2 else 0.3, seed=seed)
        for v in (split, single):
            v.open("s", prompt, params)
        drafter.open("d", prompt, params)
        x = drafter.propose(ProposeRequest("d", n, n, [], 3))
        y = drafter.propose(ProposeRequest("d", n + 3, n + 3, [], 2))  # drafted as if x were all accepted
        first = split.verify(VerifyRequest("s", n, x, start=n, defer_bonus=True))
        if first.deferred:
            deferred_seen += 1
            assert (first.accepted, first.committed_length, first.token_id) == (3, n + 3, -1)
            second = split.verify(VerifyRequest("s", n + 3, y, start=n + 3))
            both = Proposal(
                x.token_ids + y.token_ids,
                None if x.q_ids is None else torch.cat([x.q_ids, y.q_ids]),
                None if x.q_probs is None else torch.cat([x.q_probs, y.q_probs]),
            )
            whole = single.verify(VerifyRequest("s", n, both, start=n))
            assert (3 + second.accepted, second.token_id, second.committed_length) == (
                whole.accepted,
                whole.token_id,
                whole.committed_length,
            )
            # and with nothing drafted after it, the next round draws the very bonus that was deferred
            # the same round again (rolled back by start)
            split.verify(VerifyRequest("s", n, x, start=n, defer_bonus=True))
            bonus = split.verify(VerifyRequest("s", n + 3, Proposal([]), start=n + 3))
            plain = single.verify(VerifyRequest("s", n, x, start=n))
            assert plain.is_bonus and (bonus.token_id, bonus.committed_length) == (
                plain.token_id,
                plain.committed_length,
            )
        else:  # a rejection inside x: nothing is deferred and the verdict is the plain one
            assert first.token_id == single.verify(VerifyRequest("s", n, x, start=n)).token_id and not first.deferred
        for v in (split, single):
            v.close("s")
        drafter.close("d")
    assert deferred_seen >= 4  # greedy ones and some sampled ones


def test_micro_batcher_waits_briefly_so_cohorts_merge() -> None:
    """With max_wait_s, a batch smaller than the sessions held waits for the rest (bounded)."""
    seen: list[list[int]] = []

    def handle(batch: list[int]) -> list[int]:
        seen.append(list(batch))
        return batch

    with ThreadPoolExecutor(max_workers=1) as pool:
        batcher: MicroBatcher[int, int] = MicroBatcher(handle, pool, max_wait_s=1.0, expected=lambda: 3)
        first = batcher.submit_one(1)
        time.sleep(0.05)
        rest = [batcher.submit_one(2), batcher.submit_one(3)]  # arrive while the first waits
        assert [f.result(5) for f in (first, *rest)] == [1, 2, 3]
        assert seen == [[1, 2, 3]]
        lone: MicroBatcher[int, int] = MicroBatcher(handle, pool, max_wait_s=0.05, expected=lambda: 3)
        start = time.monotonic()
        assert lone.submit_one(4).result(5) == 4  # nobody else comes: it runs after at most max_wait_s
        assert time.monotonic() - start < 1.0 and seen[-1] == [4]


def test_micro_batcher_stops_waiting_a_while_after_waits_that_merged_nobody() -> None:
    """FRUITLESS_RUN waits in a row that time out with nothing arrived: the next FRUITLESS_SKIP batches run at
    once, then it waits again; a wait that merged someone ends the run."""
    seen: list[list[int]] = []

    def handle(batch: list[int]) -> list[int]:
        seen.append(list(batch))
        return batch

    def timed(batcher: MicroBatcher[int, int], request: int) -> float:
        start = time.monotonic()
        assert batcher.submit_one(request).result(5) == request
        return time.monotonic() - start

    def merges(batcher: MicroBatcher[int, int]) -> None:
        first = batcher.submit_one(1)
        time.sleep(0.03)
        second = batcher.submit_one(2)  # one of the two missing arrives during the wait
        assert (first.result(5), second.result(5)) == (1, 2) and seen[-1] == [1, 2]

    wait = 0.25  # a batch that does not wait returns in milliseconds: "< 0.8 wait" leaves room for a busy host
    with ThreadPoolExecutor(max_workers=1) as pool:
        lone: MicroBatcher[int, int] = MicroBatcher(handle, pool, max_wait_s=wait, expected=lambda: 3)
        for _ in range(FRUITLESS_RUN - 1):
            assert timed(lone, 1) >= wait  # nobody else comes: the whole wait
        merges(lone)  # a wait that merged someone: the run starts over
        for _ in range(FRUITLESS_RUN):
            assert timed(lone, 1) >= wait
        assert all(timed(lone, r) < 0.8 * wait for r in range(2, 2 + FRUITLESS_SKIP))  # these run at once
        assert timed(lone, 99) >= wait  # then a wait is tried again: fruitless, the run goes on
        assert all(timed(lone, r) < 0.8 * wait for r in range(2, 2 + FRUITLESS_SKIP))
        merges(lone)  # this wait merges someone: the run ends ...
        assert timed(lone, 1) >= wait  # ... so the next wait is whole again


def test_micro_batcher_hands_each_streams_answers_back_once_per_batch() -> None:
    """One Deliver call per stream and batch, with that stream's answers in order: one wake-up, not one per request."""
    calls: list[tuple[str, list[tuple[int, int | BaseException]]]] = []
    gate = threading.Event()

    def stream(name: str) -> Callable[[list[tuple[int, int | BaseException]]], None]:
        return lambda answered: calls.append((name, answered))

    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(gate.wait, 5)  # the model thread is busy: all four queue, then run as one batch
        batcher: MicroBatcher[int, int] = MicroBatcher(lambda batch: [x * 10 for x in batch], pool, max_batch=8)
        a, b = stream("a"), stream("b")
        batcher.submit([1, 2], a)
        batcher.submit([3], b)
        batcher.submit([4], a)
        gate.set()
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert calls == [("a", [(1, 10), (2, 20), (4, 40)]), ("b", [(3, 30)])]
