"""Faults: drafts that die, stall, lie or crawl; targets that die; overload."""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from specd.core.sampling.sampler import SamplingParams
from tests.cluster import Cluster, metrics_address, scrape, total
from tests.faults import InProcessDraftServer, LyingDrafter, SlowDrafter
from tests.references import loaded, reference

PROMPTS = [
    f"prompt {i}: " + text
    for i, text in enumerate(
        [
            "the quick brown fox",
            "def add(a, b):",
            "once upon a time",
            "SELECT * FROM t",
            "lorem ipsum dolor",
            "import os\n",
            "dear diary,",
            "1 2 3 4 5",
        ]
    )
]


def _ids(target: Path, text: str) -> list[int]:
    return list(loaded(str(target)).tokenizer(text, add_special_tokens=False).input_ids)


def _references(target: Path, n_tokens: int) -> dict[str, list[int]]:
    return {
        p: reference(target, None, _ids(target, p), SamplingParams(temperature=0), max_new_tokens=n_tokens).token_ids
        for p in PROMPTS
    }


@pytest.mark.parametrize("drafter_cls", [LyingDrafter, SlowDrafter], ids=["lying", "slow"])
def test_lying_or_slow_draft_never_changes_the_output(tiny_pair, tiny_cluster, tmp_path: Path, drafter_cls) -> None:
    target, draft = tiny_pair
    refs = _references(target, 24)
    with InProcessDraftServer(drafter_cls, draft) as bad_draft:
        args = ["--draft", bad_draft.address, "--draft-timeout-s", "1", "--draft-retry-s", "0.2"]
        cluster = Cluster(target, None, cache_dir=tmp_path, coordinator_args=args, borrow_target=tiny_cluster)
        with cluster as c, c.client() as client:
            for text in PROMPTS[:4]:
                reply = client.generate(
                    _ids(target, text),
                    max_new_tokens=24,
                    temperature=0,
                    ignore_eos=True,
                    speculation="fixed",
                    draft_length=3,
                )
                assert list(reply.token_ids) == refs[text], c.logs()
        assert bad_draft.drafter.calls > 0


def test_chaos_draft_killed_restarted_and_paused_under_32_streams(tiny_pair, tiny_cluster, tmp_path: Path) -> None:
    """32 concurrent streams while the draft dies, comes back and freezes (twice): no failure, exact output.

    Event-driven: each chaos step waits until per_step more requests have finished (bounded),
    so requests run through every state (draft up, dead, restarted, frozen) however fast the machine.
    """
    target, draft = tiny_pair
    refs = _references(target, 40)
    per_step, step_timeout_s = 4, 60.0  # 8 steps of 4: the 32 requests the test asks for at least
    args = ["--draft-timeout-s", "1", "--draft-retry-s", "0.5"]
    with Cluster(target, draft, cache_dir=tmp_path, coordinator_args=args, borrow_target=tiny_cluster) as c:
        assert c.draft is not None
        stop = threading.Event()
        progress = threading.Condition()
        failures: list[str] = []
        done = [0]

        def client_loop(worker: int) -> None:
            rng = random.Random(worker)
            with c.client(timeout=120) as client:
                while not stop.is_set():
                    text = rng.choice(PROMPTS)
                    try:
                        got = [
                            t
                            for m in client.generate_stream(
                                _ids(target, text),
                                max_new_tokens=40,
                                temperature=0,
                                ignore_eos=True,
                                speculation="fixed",
                                draft_length=4,
                            )
                            for t in m.token_ids
                        ]
                    except grpc.RpcError as exc:
                        failures.append(f"{exc.code()}: {exc.details()}")
                        continue
                    if got != refs[text]:
                        failures.append(f"wrong output for {text!r}")
                    with progress:
                        done[0] += 1
                        progress.notify_all()

        def served(what: str) -> None:
            """Wait until per_step more requests have finished (at most step_timeout_s)."""
            with progress:
                goal = done[0] + per_step
                if not progress.wait_for(lambda: done[0] >= goal, step_timeout_s):
                    failures.append(f"fewer than {per_step} requests finished in {step_timeout_s:.0f} s {what}")

        def chaos() -> None:
            assert c.draft is not None
            try:
                for _ in range(2):
                    served("with the draft up")
                    c.draft.kill()
                    served("with the draft dead")
                    c.draft.restart(c.env)  # returns once the new draft printed its banner
                    served("after the draft's restart")
                    c.draft.signal(signal.SIGSTOP)
                    served("with the draft frozen")
                    c.draft.signal(signal.SIGCONT)
            finally:
                stop.set()

        agent = threading.Thread(target=chaos)
        agent.start()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(client_loop, range(32)))
        agent.join(60)
        assert not failures, failures[:5]
        assert done[0] >= 32


def test_target_killed_mid_load_fails_fast_then_recovers(tiny_pair, tiny_cluster, tmp_path: Path) -> None:
    target, draft = tiny_pair
    ids = _ids(target, PROMPTS[0])
    args = ["--target-timeout-s", "3", "--request-timeout-s", "20"]
    with Cluster(target, draft, cache_dir=tmp_path, coordinator_args=args, borrow_draft=tiny_cluster) as c:
        outcomes: list[tuple[str, float, int]] = []
        streaming = threading.Semaphore(0)  # released once per request at its first tokens

        def call() -> None:
            started = time.monotonic()
            received = 0
            try:
                with c.client(timeout=60) as client:
                    for msg in client.generate_stream(ids, max_new_tokens=400, temperature=0, ignore_eos=True):
                        if not received:
                            streaming.release()
                        received += len(msg.token_ids)
                outcomes.append(("ok", time.monotonic() - started, received))
            except grpc.RpcError as exc:
                outcomes.append((exc.code().name, time.monotonic() - started, received))

        workers = [threading.Thread(target=call) for _ in range(8)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30  # the kill comes once every request streams (or after 30 s)
        for _ in workers:
            streaming.acquire(timeout=max(0.0, deadline - time.monotonic()))
        killed_at = time.monotonic()
        c.target.kill()
        for w in workers:
            w.join(30)
        assert not any(w.is_alive() for w in workers), "a request hung"
        assert len(outcomes) == 8
        assert all(code == "UNAVAILABLE" for code, _, _ in outcomes), outcomes
        assert max(t for _, t, _ in outcomes) - (killed_at - min(0, 0)) < 60
        assert any(received > 0 for _, _, received in outcomes)  # streams kept what they had sent
        c.target.restart(c.env)
        deadline = time.monotonic() + 15  # the coordinator's stream reconnects within its backoff (<= 2 s)
        with c.client(timeout=60) as client:
            while True:
                try:
                    assert len(client.generate(ids, max_new_tokens=8, temperature=0).token_ids) == 8
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                    time.sleep(0.5)


def test_overload_gets_resource_exhausted_quickly(tiny_pair, tiny_cluster, tmp_path: Path) -> None:
    target, draft = tiny_pair
    ids = _ids(target, PROMPTS[1])
    args = ["--max-concurrent-requests", "2"]
    shared = {"borrow_target": tiny_cluster, "borrow_draft": tiny_cluster}
    with Cluster(target, draft, cache_dir=tmp_path, coordinator_args=args, **shared) as c:
        results: list[tuple[str, float]] = []

        def call() -> None:
            started = time.monotonic()
            try:
                with c.client(timeout=60) as client:
                    client.generate(ids, max_new_tokens=300, temperature=0, ignore_eos=True)
                results.append(("OK", time.monotonic() - started))
            except grpc.RpcError as exc:
                results.append((exc.code().name, time.monotonic() - started))

        with ThreadPoolExecutor(6) as pool:
            for _ in range(6):
                pool.submit(call)
        codes = sorted(code for code, _ in results)
        assert codes.count("OK") >= 2 and codes.count("RESOURCE_EXHAUSTED") >= 1, results
        assert all(t < 5 for code, t in results if code == "RESOURCE_EXHAUSTED"), results


def test_cancelled_requests_free_their_sessions(tiny_pair, tiny_cluster, tmp_path: Path) -> None:
    """100 requests cancelled mid-stream: the draft's and target's session counts return to 0.

    The draft and target are the session's (started with --metrics-port 0), idle between tests.
    """

    target, draft = tiny_pair
    ids = _ids(target, PROMPTS[2])
    with Cluster(target, draft, cache_dir=tmp_path, borrow_target=tiny_cluster, borrow_draft=tiny_cluster) as c:
        assert c.draft is not None
        addresses = {s.name: metrics_address(s) for s in (c.draft, c.target)}

        def cancel_one(_: int) -> None:
            with c.client(timeout=60) as client:
                stream = client.generate_stream(
                    ids, max_new_tokens=200, temperature=0, ignore_eos=True, speculation="fixed", draft_length=3
                )
                next(stream)  # the request is running: both services hold its session
                stream.cancel()

        with ThreadPoolExecutor(10) as pool:
            list(pool.map(cancel_one, range(100)))
        deadline = time.monotonic() + 20
        while counts := [total(scrape(a), "specd:sessions_active") for a in addresses.values()]:
            if not any(counts):
                break
            assert time.monotonic() < deadline, f"sessions still held: {dict(zip(addresses, counts))}"
            time.sleep(0.2)


def test_kv_budget_refuses_sessions_and_bounds_memory(tiny_pair, tiny_cluster, tmp_path: Path) -> None:
    """Beyond the target's KV-cache budget, requests get RESOURCE_EXHAUSTED at once; RSS stays bounded."""
    target, draft = tiny_pair
    per_token = 2 * 3 * 2 * 16 * 4  # K and V x layers x KV heads x head dim x float32 (tiny target)
    budget = per_token * 64
    ids = _ids(target, "a prompt of about thirty byte-level tokens!")
    target_args = ["--max-kv-bytes", str(budget)]
    with Cluster(target, draft, cache_dir=tmp_path, target_args=target_args, borrow_draft=tiny_cluster) as c:
        assert c.target.pid is not None
        rss_before = c.target.peak_rss_bytes()
        results: list[tuple[str, float]] = []

        def call() -> None:
            started = time.monotonic()
            try:
                with c.client(timeout=60) as client:
                    client.generate(ids, max_new_tokens=20, temperature=0, ignore_eos=True)
                results.append(("OK", time.monotonic() - started))
            except grpc.RpcError as exc:
                results.append((exc.code().name, time.monotonic() - started))
                assert "KV-cache budget" in (exc.details() or "")

        with ThreadPoolExecutor(6) as pool:
            for _ in range(6):
                pool.submit(call)
        codes = [code for code, _ in results]
        assert "OK" in codes and "RESOURCE_EXHAUSTED" in codes, results
        assert all(t < 5 for code, t in results if code == "RESOURCE_EXHAUSTED"), results
        rss_after = c.target.peak_rss_bytes()
        assert rss_before and rss_after
        # The KV budget is tiny; what else grows (allocator, gRPC buffers) stays small.
        assert rss_after - rss_before < budget + 64 * 2**20, (rss_before, rss_after)
        with c.client(timeout=60) as client:  # and it keeps serving
            assert len(client.generate(ids, max_new_tokens=4, temperature=0).token_ids) == 4
