"""Limits at every place a caller controls memory: the public port, health, admission, the token.

Bounded tests: a fixed number of calls, each with a timeout; memory is read
from /proc for the coordinator process the test started.
"""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from coordinator.client import CoordinatorClient, build_request
from coordinator.requests import CHARS_PER_TOKEN, public_message_limit
from specd.serving.config import CoordinatorConfig
from specd.v1 import coordinator_pb2_grpc, session_pb2, target_pb2, target_pb2_grpc
from tests.cluster import Cluster
from tests.round_messages import answers, one_per_message

TOKEN = "a-token-of-enough-characters"
CONTEXT = 512  # the tiny models'
MiB = 1 << 20
ACTIVE_TOKENS = 450  # --max-active-tokens of the module's coordinator


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def cluster(tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory):
    """A coordinator with a token and tight caps, on the session's target and draft."""
    target, draft = tiny_pair
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    args = [
        *("--api-token-file", str(token_file), "--max-concurrent-requests", "2", "--max-concurrent-rpcs", "300"),
        *("--max-active-tokens", str(ACTIVE_TOKENS)),
    ]
    shared = {"borrow_target": tiny_cluster, "borrow_draft": tiny_cluster}
    with Cluster(target, draft, cache_dir=tmp_path_factory.mktemp("cache"), coordinator_args=args, **shared) as c:
        yield c


def _client(cluster: Cluster) -> CoordinatorClient:
    return CoordinatorClient(cluster.address, token=TOKEN, timeout=60)


def _ok(cluster: Cluster) -> None:
    with _client(cluster) as client:
        reply = client.generate("still serving", max_new_tokens=3, temperature=0, ignore_eos=True)
    assert len(reply.token_ids) == 3


def test_200_health_watch_streams_with_1mib_names_hold_no_memory(cluster: Cluster) -> None:
    pid = cluster.coordinator.pid
    assert pid is not None
    _ok(cluster)
    before = _rss_bytes(pid)
    name = "x" * MiB
    with grpc.insecure_channel(cluster.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=30) for _ in range(200)]
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            codes.append(err.value.code())
        _ok(cluster)  # ordinary requests keep succeeding meanwhile
        grown = _rss_bytes(pid) - before
        for call in calls:
            call.cancel()
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    print(f"coordinator RSS grew by {grown / MiB:.1f} MiB over 200 Watch calls of 1 MiB names")
    assert grown < 64 * MiB


def test_watch_with_the_token_serves_only_known_names(cluster: Cluster) -> None:
    meta = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        unknown = list(stub.Watch(health_pb2.HealthCheckRequest(service="y" * 1000), timeout=10, metadata=meta))
        assert [r.status for r in unknown] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]  # and it ended
        known = stub.Watch(health_pb2.HealthCheckRequest(service="specd.v1.Coordinator"), timeout=10, metadata=meta)
        assert next(known).status == health_pb2.HealthCheckResponse.SERVING
        known.cancel()


def test_only_health_check_skips_the_token(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(Exception, match=r"UNAUTHENTICATED|token"):
            ProtoReflectionDescriptorDatabase(channel).get_services()
    # grpcurl-style: the token header on reflection calls too
    with grpc.insecure_channel(cluster.address) as channel:
        intercepted = grpc.intercept_channel(channel, _Header(("authorization", f"Bearer {TOKEN}")))
        assert "specd.v1.Coordinator" in ProtoReflectionDescriptorDatabase(intercepted).get_services()


class _Header(grpc.StreamStreamClientInterceptor):
    def __init__(self, header: tuple[str, str]) -> None:
        self.header = header

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        details = details._replace(metadata=[*(details.metadata or ()), self.header])
        return continuation(details, request_iterator)


def test_caps_are_checked_from_counts_and_oversized_messages_are_refused_unread(cluster: Cluster) -> None:
    config = CoordinatorConfig()
    cases = [
        (build_request([{"role": "user", "content": "x"}] * (config.max_chat_messages + 1)), "messages"),
        (build_request("x", stop_token_ids=[1] * (config.max_stop_token_ids + 1)), "stop token ids"),
        (build_request("x", stop=["s"] * (config.max_stop_strings + 1)), "stop strings"),
        (build_request("x" * (CHARS_PER_TOKEN * CONTEXT + 1)), "characters"),
        (build_request([1] * CONTEXT), "context"),
    ]
    with _client(cluster) as client:
        stub = coordinator_pb2_grpc.CoordinatorStub(client._channel)
        meta = (("authorization", f"Bearer {TOKEN}"),)
        for request, needle in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request, timeout=30, metadata=meta)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert needle in err.value.details(), err.value.details()
        too_big = build_request("x" * (public_message_limit(config, CONTEXT) + 1))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(too_big, timeout=30, metadata=meta)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _ok(cluster)


def test_admission_comes_before_the_per_item_checks(cluster: Cluster) -> None:
    """With the coordinator full, a request is refused before its token IDs are scanned."""
    started = threading.Barrier(3)
    results: list[object] = []

    def hold() -> None:
        with _client(cluster) as client:
            stream = client.generate_stream("hold", max_new_tokens=200, temperature=0, ignore_eos=True)
            first = next(stream)
            started.wait(30)
            results.append(first)
            for _ in stream:
                pass

    threads = [threading.Thread(target=hold) for _ in range(2)]  # --max-concurrent-requests 2
    for t in threads:
        t.start()
    started.wait(60)
    with _client(cluster) as client, pytest.raises(grpc.RpcError) as err:
        client.generate([CONTEXT * 1000] * 100, max_new_tokens=2)  # bad IDs: would be INVALID_ARGUMENT
    for t in threads:
        t.join(120)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()


def test_admission_counts_prompt_and_new_tokens(cluster: Cluster) -> None:
    with _client(cluster) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hello", max_new_tokens=ACTIVE_TOKENS - 4, temperature=0)  # 5 + 446 > 450
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens" in err.value.details()
        reply = client.generate("hello", max_new_tokens=ACTIVE_TOKENS - 5, temperature=0, stop_token_ids=[])
        assert reply.stats.completion_tokens >= 1


def test_concurrent_rpcs_are_capped(tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = ["--api-token-file", str(token_file), "--max-concurrent-rpcs", "4"]
    meta = (("authorization", f"Bearer {TOKEN}"),)
    cluster = Cluster(
        tiny_pair[0], None, cache_dir=tmp_path / "cache", coordinator_args=args, borrow_target=tiny_cluster
    )
    with cluster as c, grpc.insecure_channel(c.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        held = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30, metadata=meta) for _ in range(4)]
        for call in held:
            assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in held:
            call.cancel()


# ---- sessions belong to their stream -------------------------------------------------------------


def test_a_session_belongs_to_the_stream_that_opened_it(cluster: Cluster) -> None:
    def opening(sid: str) -> target_pb2.TargetRequest:
        req = target_pb2.TargetRequest(request_id=1, session_id=sid, committed_length=3)
        req.open.token_ids.extend([104, 105, 33])
        req.open.sampling.seed = 1
        req.open.sampling.temperature = 0.0
        return req

    def verify(sid: str, request_id: int) -> target_pb2.TargetRequest:
        req = target_pb2.TargetRequest(request_id=request_id, session_id=sid, committed_length=3)
        req.verify.start = 3
        return req

    with grpc.insecure_channel(cluster.target.address) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        outbox: Queue = Queue()
        owner = answers(stub.Rounds(one_per_message(iter(outbox.get, None)), timeout=60))
        outbox.put(opening("shared-name"))
        assert next(owner).WhichOneof("result") == "ack"
        # Another stream cannot reach it, even by its exact ID.
        other = list(answers(stub.Rounds(one_per_message([verify("shared-name", 1)]), timeout=30)))
        assert other[0].error.code == session_pb2.SessionError.CODE_SESSION_NOT_FOUND
        assert other[0].session_id == "shared-name"  # answers speak the caller's IDs
        # ... and its own session of that name is another session.
        own = list(
            answers(stub.Rounds(one_per_message([opening("shared-name"), verify("shared-name", 2)]), timeout=30))
        )
        assert [r.WhichOneof("result") for r in own] == ["ack", "verdict"]
        outbox.put(verify("shared-name", 3))
        reply = next(owner)
        assert reply.WhichOneof("result") == "verdict" and reply.session_id == "shared-name"
        outbox.put(None)
