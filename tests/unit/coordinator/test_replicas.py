"""The replica set against real target services in-process: streams, health, load, draining, loss, discovery."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from coordinator.client import build_request
from coordinator.discovery import parse_peer_address
from coordinator.peers import GrpcTarget, open_channel
from coordinator.placement import Load
from coordinator.replica_ports import ReplicatedTarget
from coordinator.replicas import ReplicaSet, SameModel, model_mismatch
from coordinator.server import create_server as create_coordinator
from draft_service.server import create_server as create_draft_server
from specd.core.errors import SessionNotFound
from specd.core.rounds.steps import CloseRequest, OpenRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.serving.config import CoordinatorConfig, DraftConfig, TargetConfig
from specd.serving.server import ServiceHandle
from specd.v1 import common_pb2, coordinator_pb2_grpc
from target_service.server import SERVICE_NAME, create_server

PARAMS = SamplingParams(temperature=0.0, seed=1)


async def _target(folder: Path, max_sessions: int = 256) -> ServiceHandle:
    handle = create_server(
        TargetConfig(host="127.0.0.1", port=0, model=str(folder), batch_wait_ms=0, max_sessions=max_sessions)
    )
    await handle.server.start()
    await handle.set_serving(True)
    return handle


def _set(address: str, **kwargs) -> ReplicaSet[GrpcTarget]:
    return ReplicaSet(
        "target",
        parse_peer_address(address),
        open_channel=lambda r: open_channel(r.address),
        make_peer=lambda channel, name: GrpcTarget(channel),
        service_name=SERVICE_NAME,
        check=SameModel(),
        poll_s=0.1,
        **kwargs,
    )


async def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _two_replicas(folder: Path) -> AsyncIterator[tuple[ReplicaSet[GrpcTarget], ServiceHandle, ServiceHandle]]:
    """Two target services and a started replica set over both, usable; all stopped at the end."""
    a, b = await _target(folder), await _target(folder)
    replicas = _set(f"127.0.0.1:{a.port},127.0.0.1:{b.port}")
    try:
        await replicas.start()
        await _until(lambda: len(replicas.usable_names()) == 2)
        yield replicas, a, b
    finally:
        await replicas.close()
        await a.stop(0)
        await b.stop(0)


def test_sessions_spread_and_drain_and_move(tiny_pair) -> None:
    target, _ = tiny_pair

    async def main() -> None:
        async with _two_replicas(target) as (replicas, a, b):
            name_a, name_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
            # 8 sessions open: 4 on each
            for i in range(8):
                member, left = replicas.place(f"s{i}")
                assert left is None
                await member.peer.open(OpenRequest(f"s{i}", [1, 2, 3], PARAMS), timeout=10, carrier={})
                await member.peer.verify(
                    VerifyRequest(f"s{i}", 3, _empty()), timeout=10, carrier={}
                )  # prefills the KV cache
            assert sorted(replicas.placement.sessions_on(n) for n in (name_a, name_b)) == [4, 4]
            # each replica reports the sessions it holds through the Load service
            await _until(lambda: all(_reported(replicas, n).sessions == 4 for n in (name_a, name_b)))
            assert all(_reported(replicas, n).kv_bytes > 0 for n in (name_a, name_b))

            # a drains (NOT_SERVING): no new session there, its sessions stay and keep working
            await a.set_serving(False)
            await _until(lambda: replicas.usable_names() == [name_b])
            on_a = [f"s{i}" for i in range(8) if replicas.placement.where(f"s{i}") == name_a]
            for i in range(4):
                assert replicas.place(f"new{i}")[0].name == name_b
            for sid in on_a:
                holder = replicas.holder(sid)
                assert holder is not None and holder.name == name_a
                await holder.peer.verify(VerifyRequest(sid, 4, _empty()), timeout=10, carrier={})

            # a comes back, b is stopped: b's sessions have no holder and move to a when re-opened
            await a.set_serving(True)
            await b.stop(0)
            on_b = [f"s{i}" for i in range(8) if replicas.placement.where(f"s{i}") == name_b]
            await _until(lambda: all(replicas.holder(s) is None for s in on_b))
            await _until(lambda: replicas.usable_names() == [name_a])
            for sid in on_b:
                member, left = replicas.place(sid)
                assert member.name == name_a and left is None  # b is down: nothing to close there
                await member.peer.open(OpenRequest(sid, [1, 2, 3, 4], PARAMS), timeout=10, carrier={})
            assert replicas.moves == len(on_b)

    asyncio.run(main())


def test_a_replica_that_missed_a_health_check_gets_no_new_session_while_another_answers(tiny_pair) -> None:
    """A frozen replica's stream looks up until UNANSWERED_LIMIT checks time out; meanwhile new sessions
    go to the replicas that answer, its own sessions stay (a slow replica is not lost), and a set whose
    every replica is silent still places."""
    target, _ = tiny_pair

    async def main() -> None:
        async with _two_replicas(target) as (replicas, a, b):
            name_a, name_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
            home = next(f"s{i}" for i in range(8) if replicas.place(f"s{i}")[0].name == name_a)
            # no await below: the watch loop cannot reset the counts before the placements are made
            replicas.members[name_a].unanswered = 1
            assert [replicas.place(f"new{i}")[0].name for i in range(6)] == [name_b] * 6
            assert replicas.place(home)[0].name == name_a
            replicas.members[name_b].unanswered = 1
            assert replicas.place("last")[0].name in (name_a, name_b)

    asyncio.run(main())


def test_a_replica_found_by_dns_gets_sessions_and_one_that_leaves_retires(tiny_pair) -> None:
    target, _ = tiny_pair
    answers: dict[str, list[str]] = {"svc": []}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    async def main() -> None:
        a, b = await _target(target), await _target(target)
        static = f"127.0.0.1:{a.port}"
        # the name resolves to the loopback address; the port is b's
        replicas = _set(f"{static},dns:///svc:{b.port}", resolve=resolve, resolve_interval_s=0.1)
        try:
            await replicas.start()
            await _until(lambda: replicas.usable_names() == [static])
            for i in range(3):
                member, _ = replicas.place(f"s{i}")
                await member.peer.open(OpenRequest(f"s{i}", [5, 6], PARAMS), timeout=10, carrier={})
            answers["svc"] = ["127.0.0.1"]  # b appears
            b_name = f"127.0.0.1:{b.port}"
            await _until(lambda: b_name in replicas.usable_names())
            member, _ = replicas.place("late")
            assert member.name == b_name and member.replica.authority == "svc"  # least loaded: 0 vs 3
            await member.peer.open(OpenRequest("late", [5, 6], PARAMS), timeout=10, carrier={})
            answers["svc"] = ["127.0.0.2"]  # b leaves DNS (and a replica we cannot reach appears)
            await _until(lambda: replicas.members[b_name].retiring)
            assert replicas.holder("late") is not None  # its session still runs there
            replicas.release("late")
            await _until(lambda: b_name not in replicas.members)  # idle: closed
            assert replicas.usable_names() == [static]
            states = {d["replica"]: d["state"] for d in replicas.describe()}
            assert states == {static: "serving", "127.0.0.2:" + str(b.port): "down"}
        finally:
            await replicas.close()
            await a.stop(0)
            await b.stop(0)

    asyncio.run(main())


def test_port_opens_on_another_replica_when_one_is_full_and_moves_lost_sessions(tiny_pair) -> None:
    target, _ = tiny_pair

    async def main() -> None:
        a, b = await _target(target, max_sessions=1), await _target(target)
        name_a, name_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        replicas = _set(f"{name_a},{name_b}")
        port = ReplicatedTarget(replicas)
        try:
            await replicas.start()
            await _until(lambda: len(replicas.usable_names()) == 2)
            replicas.placement.report(name_b, Load(sessions=5))  # a looks idler: the first two go there
            for sid in ("s0", "s1"):
                await port.open(OpenRequest(sid, [1, 2, 3], PARAMS), timeout=10, carrier={})
            # a holds one session (its limit); the second was refused there and opened on b
            assert {port.replica_of("s0"), port.replica_of("s1")} == {name_a, name_b}
            on_b = "s0" if port.replica_of("s0") == name_b else "s1"
            out = await port.verify(VerifyRequest(on_b, 3, _empty()), timeout=10, carrier={})
            assert out.committed_length == 4
            await b.stop(0)  # b is lost: its session is not found; re-opened, it lands on a (room freed below)
            await _until(lambda: replicas.holder(on_b) is None)
            with pytest.raises(SessionNotFound):
                await port.verify(VerifyRequest(on_b, 4, _empty()), timeout=10, carrier={})
            await port.close(CloseRequest("s0" if on_b == "s1" else "s1"), timeout=10)
            await port.open(OpenRequest(on_b, [1, 2, 3, 9], PARAMS), timeout=10, carrier={})
            assert port.replica_of(on_b) == name_a and replicas.moves == 1
            out = await port.verify(VerifyRequest(on_b, 4, _empty()), timeout=10, carrier={})
            assert out.committed_length == 5
        finally:
            await replicas.close()
            await a.stop(0)
            await b.stop(0)

    asyncio.run(main())


def test_target_replicas_must_serve_the_same_model() -> None:
    ref = common_pb2.ModelInfo(vocab_size=10, tokenizer_size=10, vocab_hash="x", max_context=64, eos_token_ids=[2])
    same = common_pb2.ModelInfo()
    same.CopyFrom(ref)
    same.name = "another-path"
    assert model_mismatch(ref, same) is None
    other = common_pb2.ModelInfo()
    other.CopyFrom(ref)
    other.max_context = 128
    assert "max_context" in (model_mismatch(ref, other) or "")
    check = SameModel()
    assert check(ref) is None and check(other) is not None


def _empty() -> Proposal:
    return Proposal([])


def _reported(replicas: ReplicaSet[GrpcTarget], name: str) -> Load:
    return replicas.placement.reported(name) or Load(sessions=-1)


def test_the_coordinator_places_each_draft_replicas_sessions_on_its_paired_target() -> None:
    """Two emulated targets and two drafts in-process behind a coordinator: while 8 requests run, every
    session's draft replica and target replica are one of two fixed pairs (coordinator/placement.py)."""
    model = "sim:h100-8b,time_scale=0"

    async def main() -> set[tuple[str | None, str | None]]:
        services = [create_server(TargetConfig(host="127.0.0.1", port=0, model=model)) for _ in range(2)]
        services += [
            create_draft_server(DraftConfig(host="127.0.0.1", port=0, model=model, target_model=model))
            for _ in range(2)
        ]
        for s in services:
            await s.server.start()
            await s.set_serving(True)
        names = [f"127.0.0.1:{s.port}" for s in services]
        config = CoordinatorConfig(
            target=",".join(names[:2]), draft=",".join(names[2:]), tokenizer=model, port=0, replica_poll_s=0.1
        )
        handle, engine = await create_coordinator(config)
        await handle.server.start()
        assert engine.draft is not None
        pairs: set[tuple[str | None, str | None]] = set()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                calls = [
                    stub.Generate(
                        build_request(
                            f"pair {i}", max_new_tokens=48, temperature=0.0, ignore_eos=True, speculation="fixed"
                        )
                    )
                    for i in range(8)
                ]
                running = asyncio.gather(*calls)
                while not running.done():
                    for sid in engine.target.replicas.placement.placed():
                        pairs.add((engine.draft.replica_of(sid), engine.target.replica_of(sid)))
                    await asyncio.sleep(0.002)
                await running
        finally:
            await handle.stop(1.0)
            for s in services:
                await s.stop(0)
        return {p for p in pairs if None not in p}  # a session whose other half is not opened yet

    pairs = asyncio.run(main())
    assert len(pairs) == 2, pairs  # both pairs served sessions, and no session crossed them
    assert len({d for d, _ in pairs}) == len({t for _, t in pairs}) == 2
