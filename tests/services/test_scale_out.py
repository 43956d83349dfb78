"""Scale-out with real processes: one coordinator over 2 target and 2 draft replicas (tiny pair).

- 32 concurrent streams: a burst of sessions splits evenly (each replica within 40/60),
  greedy outputs equal target-only decoding.
- Under the same load a target replica is killed: no request fails and every
  output stays exact (its sessions are rebuilt on the other replica); then a
  third target replica starts on an address the coordinator was given, and
  new sessions go to it.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from coordinator.client import CoordinatorClient
from specd.serving import trace_names
from specd.tools.localcluster import ServiceProcess as QuietService  # fresh interpreters (see pytestmark)
from specd.tools.otlp_receiver import OtlpReceiver
from tests.cluster import metrics_address, scrape, stop_together, total
from tests.services.test_faults import PROMPTS, _ids, _references

# alone: the split checks count where the coordinator placed sessions, and a busy neighbour on the same
# cores slows one replica of a pair (seen under two test workers: the drafts split 40/24). Its services
# are fresh interpreters, as before the tests' fork server: with forked ones the same 40/24 split came
# once in the alone pass (2026-12-04), and the split bounds below were set with fresh interpreters.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

STREAMS = 32
TOKENS = 24


def _placements(coordinator: QuietService, role: str) -> dict[str, float]:
    samples = scrape(metrics_address(coordinator))
    return {
        dict(labels)["replica"]: value
        for (name, labels), value in samples.items()
        if name == "specd:replica_placements_total" and dict(labels)["role"] == role
    }


def _generate(address: str, target: Path, text: str) -> list[int]:
    with CoordinatorClient(address, timeout=120) as client:
        return [
            t
            for m in client.generate_stream(
                _ids(target, text),
                max_new_tokens=TOKENS,
                temperature=0,
                ignore_eos=True,
                speculation="fixed",
                draft_length=3,
            )
            for t in m.token_ids
        ]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def test_two_targets_two_drafts_split_heal_and_grow(tiny_pair, tmp_path: Path, receiver: OtlpReceiver) -> None:
    target, draft = tiny_pair
    refs = _references(target, TOKENS)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPECD_CACHE_DIR=str(tmp_path))
    common = ["--host", "127.0.0.1", "--port", "0", "--torch-threads", "1", "--batch-wait-ms", "1"]

    def target_service(port: str = "0") -> QuietService:
        args = ["target", "--model", str(target), *common]
        args[args.index("--port") + 1] = port
        return QuietService("target", args)

    def draft_service() -> QuietService:
        return QuietService("draft", ["draft", "--model", str(draft), "--target-model", str(target), *common])

    targets = [target_service(), target_service()]
    drafts = [draft_service(), draft_service()]
    spare_port = _free_port()  # where the third target replica will appear
    services = [*targets, *drafts]
    third: list[QuietService] = []  # the replica started under load
    coordinator = None
    try:
        for s in services:
            s.start(env)
        for s in services:
            s.wait_ready(120)
        coordinator = QuietService(
            "coordinator",
            [
                "coordinator",
                *common[:4],
                "--metrics-port",
                "0",
                "--target",
                ",".join([*(t.address or "" for t in targets), f"127.0.0.1:{spare_port}"]),
                "--draft",
                ",".join(d.address or "" for d in drafts),
                "--tokenizer",
                str(target),
                "--replica-poll-s",
                "0.5",
                "--draft-timeout-s",
                "5",
                "--max-concurrent-requests",
                "128",
                "--otlp-endpoint",
                receiver.endpoint,
                "--trace-sample-ratio",
                "0.25",
            ],
        )
        coordinator.start(env)
        address = coordinator.wait_ready(120)

        # ---- 32 concurrent streams: an even split, exact outputs --------------------------------
        # The split is checked on the first wave, which opens its 32 sessions at once: least-loaded
        # placement counts its own placements between load reports, so a burst splits evenly. The
        # second wave's sessions go where the first ones finished, which follows how fast each
        # replica ran on the shared cores (seen: 39/25 of 64 over both waves in the alone pass).
        prompts = list(itertools.islice(itertools.cycle(PROMPTS), 2 * STREAMS))
        with ThreadPoolExecutor(STREAMS) as pool:
            outputs = list(pool.map(lambda p: _generate(address, target, p), prompts[:STREAMS]))
            for role, replicas in (("target", targets), ("draft", drafts)):
                placed = _placements(coordinator, role)
                counts = [placed.get(s.address or "", 0.0) for s in replicas]
                assert sum(counts) >= STREAMS, (role, placed)
                assert all(0.4 <= c / sum(counts) <= 0.6 for c in counts), (role, placed)
            outputs += pool.map(lambda p: _generate(address, target, p), prompts[STREAMS:])
        wrong = [p for p, got in zip(prompts, outputs) if got != refs[p]]
        assert not wrong, wrong[:3]

        # Round spans name the replicas that held their sessions.
        def named(spans: list, key: str) -> set:
            return {s.attributes.get(key) for s in spans if s.name == trace_names.SPAN_ROUND and s.attributes.get(key)}

        # spans arrive in export batches: wait (bounded) until both roles' replicas have shown up
        spans = receiver.wait_for(
            lambda spans: len(named(spans, trace_names.ATTR_TARGET_REPLICA)) >= 2
            and len(named(spans, trace_names.ATTR_DRAFT_REPLICA)) >= 2,
            timeout=60,
        )
        rounds = [s for s in spans if s.name == trace_names.SPAN_ROUND]
        assert {r.attributes.get(trace_names.ATTR_TARGET_REPLICA) for r in rounds} == {t.address for t in targets}
        drafted = {
            r.attributes.get(trace_names.ATTR_DRAFT_REPLICA)
            for r in rounds
            if r.attributes[trace_names.ATTR_ROUND_DRAFT_TOKENS]
        }
        assert drafted == {d.address for d in drafts}

        # ---- the same load while a target replica dies and a new one appears -----------------
        failures: list[str] = []
        done = [0]
        stop = threading.Event()

        def client_loop(worker: int) -> None:
            for text in itertools.cycle(PROMPTS[worker % len(PROMPTS) :] + PROMPTS[: worker % len(PROMPTS)]):
                if stop.is_set():
                    return
                try:
                    got = _generate(address, target, text)
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code()}: {exc.details()}")
                    continue
                if got != refs[text]:
                    failures.append(f"wrong output for {text!r}")
                done[0] += 1

        timeline: dict[str, float] = {}

        def chaos() -> None:
            try:
                deadline = (
                    time.monotonic() + 60
                )  # the kill comes under load: once a quarter of the streams finished a request
                while done[0] < STREAMS // 4 and time.monotonic() < deadline and not stop.is_set():
                    time.sleep(0.05)
                before = done[0]
                targets[0].kill()
                timeline["killed"] = time.monotonic()
                while done[0] < before + STREAMS and not stop.is_set():  # every stream finished a request since
                    time.sleep(0.2)
                new = target_service(str(spare_port))
                third.append(new)
                new.start(env)
                new.wait_ready(120)
                timeline["third ready"] = time.monotonic()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not _placements(coordinator, "target").get(new.address or ""):
                    time.sleep(0.25)
                timeline["third placed"] = time.monotonic()
                before = done[0]
                while done[0] < before + STREAMS and time.monotonic() < deadline:
                    time.sleep(0.2)
            finally:
                stop.set()

        agent = threading.Thread(target=chaos)
        agent.start()
        with ThreadPoolExecutor(STREAMS) as pool:
            list(pool.map(client_loop, range(STREAMS)))
        agent.join(180)
        assert not failures, failures[:5]
        assert third, "the third replica was not started"
        placed = _placements(coordinator, "target")
        assert placed.get(third[0].address or "", 0) > 0, (placed, coordinator.lines[-30:])
        print(
            f"requests under chaos: {done[0]}; third replica's first session "
            f"{timeline['third placed'] - timeline['third ready']:.1f} s after it was ready; placements {placed}"
        )
        # the killed replica's sessions left it: the ones that lived there (the metric's moves) and the
        # ones whose first open it never answered (re-opened elsewhere, no move: they never lived there)
        left = sum(f"moves from {targets[0].address} " in line for line in coordinator.lines)
        moves = total(scrape(metrics_address(coordinator)), "specd:replica_session_moves_total", role="target")
        assert left > 0 and moves <= left, (moves, "".join(coordinator.lines[-60:]))
    finally:
        if coordinator is not None:
            coordinator.stop(grace_s=5)  # first: it drains its requests
        stop_together([*services, *third], grace_s=5)  # the replicas at once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_frozen_target_replica_loses_its_sessions_to_the_other(tiny_pair, tmp_path: Path) -> None:
    """SIGSTOP one of two targets under 16 streams: its connection stays open but it stops answering;
    after a few unanswered health checks its stream is restarted, its sessions move, no request fails."""
    target, _ = tiny_pair
    refs = _references(target, TOKENS)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPECD_CACHE_DIR=str(tmp_path))
    common = ["--host", "127.0.0.1", "--port", "0", "--torch-threads", "1"]
    targets = [QuietService("target", ["target", "--model", str(target), *common]) for _ in range(2)]
    coordinator = None
    try:
        for t in targets:
            t.start(env)
        for t in targets:
            t.wait_ready(120)
        coordinator = QuietService(
            "coordinator",
            [
                "coordinator",
                *common[:4],
                "--metrics-port",
                "0",
                "--target",
                ",".join(t.address or "" for t in targets),
                "--draft",
                "none",
                "--tokenizer",
                str(target),
                "--replica-poll-s",
                "0.5",
            ],
        )
        coordinator.start(env)
        address = coordinator.wait_ready(120)
        failures: list[str] = []
        stop = threading.Event()
        done = [0]

        def client_loop(worker: int) -> None:
            while not stop.is_set():
                text = PROMPTS[(worker + done[0]) % len(PROMPTS)]
                try:
                    got = _generate(address, target, text)
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code()}: {exc.details()}")
                    continue
                if got != refs[text]:
                    failures.append(f"wrong output for {text!r}")
                done[0] += 1

        def freeze() -> None:
            assert targets[0].proc is not None
            try:
                # the freeze comes under load, once every client has finished a request or so: sessions
                # caught in their first open there never lived on the replica, so their re-opens are no moves
                deadline = time.monotonic() + 60
                while done[0] < 20 and time.monotonic() < deadline:
                    time.sleep(0.05)
                targets[0].proc.send_signal(signal.SIGSTOP)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                    "restarting its stream" in line for line in coordinator.lines
                ):
                    time.sleep(0.2)
                before = done[0]
                while done[0] < before + 16 and time.monotonic() < deadline:
                    time.sleep(0.2)
            finally:
                targets[0].proc.send_signal(signal.SIGCONT)
                stop.set()

        agent = threading.Thread(target=freeze)
        agent.start()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(client_loop, range(16)))
        agent.join(120)
        assert not failures, failures[:5]
        assert any("restarting its stream" in line for line in coordinator.lines), "".join(coordinator.lines[-30:])
        # every session caught there left it: the ones that lived there (the metric's moves) and the
        # ones whose first open it never answered (re-opened elsewhere, no move: they never lived there)
        left = sum(f"moves from {targets[0].address} " in line for line in coordinator.lines)
        moves = total(scrape(metrics_address(coordinator)), "specd:replica_session_moves_total", role="target")
        assert left > 0 and moves <= left, (moves, "".join(coordinator.lines[-60:]))
    finally:
        if coordinator is not None:
            coordinator.stop(grace_s=5)
        stop_together(targets, grace_s=5)
