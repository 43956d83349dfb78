"""Plumbing every specd gRPC service shares: health, reflection, errors, shutdown."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.serving.config import ServiceBase
from specd.serving.grpc_errors import ErrorMappingInterceptor
from specd.serving.security import server_credentials

log = logging.getLogger(__name__)

# Generous limits: a prompt of 100k tokens is ~500 kB on the wire.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_metadata_size", 16 * 1024),
    *KEEPALIVE_OPTIONS,
]
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted peer is found within a second (gRPC's default backoff grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *KEEPALIVE_OPTIONS,
]


@dataclass
class ServiceHandle:
    """A started server and what shutting it down gracefully needs."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: Sequence[str]
    on_stop: Callable[[], Awaitable[None] | None] | None = None  # frees what the service holds

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, let in-flight calls finish for grace_s, then stop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.on_stop is not None:
            result = self.on_stop()
            if inspect.isawaitable(result):
                await result


def build_server(
    config: ServiceBase,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """A grpc.aio server with the services, health and reflection; bound, not started."""
    server = grpc.aio.server(
        interceptors=[ErrorMappingInterceptor(), *interceptors],
        options=SERVER_OPTIONS,
    )
    register(server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{config.host}:{config.port}"
    if config.tls_enabled:  # TLS only: a plaintext client fails the handshake
        port = server.add_secure_port(
            address, server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        )
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    return server, port, health_servicer


async def serve_until_signal(handle: ServiceHandle, grace_s: float, banner: str) -> None:
    """Run a started service until SIGTERM/SIGINT, then stop it gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await handle.set_serving(True)
    print(banner, flush=True)
    await stop.wait()
    log.info("shutting down: NOT_SERVING, %.1f s grace for in-flight calls", grace_s)
    await handle.stop(grace_s)
