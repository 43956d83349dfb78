"""Every gRPC server's connection limits: idle connections closed, slow handshakes dropped, ages by service.

In-process: one grpc.aio server (build_server, as every service builds it) on 127.0.0.1, timers cut to 0.3 s.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.core.errors import InvalidArgument
from specd.serving.config import CoordinatorConfig, DraftConfig, ServiceBase, TargetConfig
from specd.serving.server import build_server, connection_options

LIMIT_S = 0.3


async def _started(config: ServiceBase) -> tuple[grpc.aio.Server, int]:
    server, port, _ = build_server(config, lambda s: None, [])
    await server.start()
    return server, port


async def _seconds_until_closed(port: int, within_s: float) -> float:
    """Connect, send nothing, read what the server sends (its SETTINGS, a GOAWAY) until it closes the socket."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)
        while await asyncio.wait_for(loop.sock_recv(sock, 4096), within_s - (time.monotonic() - started)):
            pass
    return time.monotonic() - started


def test_a_client_that_never_finishes_the_handshake_is_dropped() -> None:
    async def main() -> tuple[float, bool]:
        server, port = await _started(ServiceBase(handshake_timeout_s=LIMIT_S))
        try:
            slow = await _seconds_until_closed(port, within_s=5.0)  # gRPC's own default would wait 120 s
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # a real client still gets in
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return slow, reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    slow, served = asyncio.run(main())
    assert LIMIT_S * 0.8 <= slow < LIMIT_S + 1.0 and served


def test_an_idle_connection_is_closed_and_the_client_reconnects() -> None:
    async def main() -> tuple[float, bool]:
        server, port = await _started(ServiceBase(max_connection_idle_s=LIMIT_S))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert channel.get_state() is grpc.ChannelConnectivity.READY
                started = time.monotonic()
                # The server's GOAWAY ("connection idle") takes the channel from READY to IDLE.
                await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 5)
                idle_after = time.monotonic() - started
                again = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # a new connection
                return idle_after, again.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    idle_after, served = asyncio.run(main())
    assert idle_after < LIMIT_S + 1.0 and served


def test_ages_default_to_off_on_draft_and_target_only() -> None:
    def options(config: ServiceBase) -> dict[str, int]:
        config.validate()
        return dict(connection_options(config))

    coordinator = options(CoordinatorConfig())
    assert coordinator["grpc.max_connection_age_ms"] == 1_800_000
    # An in-flight Generate (up to --request-timeout-s, 300 s) finishes inside the grace.
    assert coordinator["grpc.max_connection_age_grace_ms"] > 300_000
    assert coordinator["grpc.max_connection_idle_ms"] == 300_000
    assert coordinator["grpc.server_handshake_timeout_ms"] == 10_000
    for internal in (DraftConfig(), TargetConfig()):  # the coordinator's round streams must not be cut
        got = options(internal)
        assert "grpc.max_connection_age_ms" not in got and got["grpc.server_handshake_timeout_ms"] == 10_000
    assert options(DraftConfig(max_connection_age_s=60))["grpc.max_connection_age_ms"] == 60_000
    off = options(CoordinatorConfig(max_connection_age_s=0, max_connection_idle_s=0))
    assert "grpc.max_connection_age_ms" not in off and "grpc.max_connection_idle_ms" not in off


@pytest.mark.parametrize(
    "setting",
    [
        {"max_connection_idle_s": -1.0},
        {"max_connection_age_s": -2.0},
        {"max_connection_age_grace_s": 3e6},
        {"handshake_timeout_s": 0.0},
    ],
)
def test_connection_limits_out_of_range_are_refused(setting: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument, match=r"--(max-connection|handshake)"):
        ServiceBase(**setting).validate()
