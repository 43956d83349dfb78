"""Plumbing every specd gRPC service shares: health, reflection, errors, shutdown."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.core.errors import InvalidArgument
from specd.serving.config import ModelServiceBase, ServiceBase
from specd.serving.grpc_errors import ErrorMappingInterceptor
from specd.serving.reloading import ReloadingServerCredentials
from specd.serving.security import ClientNameInterceptor

try:
    import uvloop
except ImportError:  # an optional speed-up (no wheel for every platform): asyncio's own loop then
    uvloop = None  # type: ignore[assignment]  # the module or None: mypy types the name as the module

log = logging.getLogger(__name__)
T = TypeVar("T")

# The default message limit; the coordinator sizes its public one to its prompt limits
# (coordinator.requests.public_message_limit), draft and target to their context.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
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


def server_options(max_message_bytes: int, max_streams_per_connection: int) -> list[tuple[str, int]]:
    """Server channel arguments: message and metadata limits, streams per connection, keepalive."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_metadata_size", 16 * 1024),
        # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: one connection cannot open more at once.
        ("grpc.max_concurrent_streams", max_streams_per_connection),
        # No BDP probing: it grows every stream's receive window, so calls that are refused
        # unread still had their messages buffered. 200 refused health calls with 1 MiB
        # names grew the coordinator by 38.5 MiB with probing, 1.3 MiB without (one run
        # each, tests/services/test_limits.py). The services' messages are small; nothing needs it.
        ("grpc.http2.bdp_probe", 0),
        *KEEPALIVE_OPTIONS,
    ]


SERVER_OPTIONS = server_options(MAX_MESSAGE_BYTES, 128)
PUBLIC_MAX_CONNECTION_AGE_S = 1800.0  # --max-connection-age-s -1 on the coordinator


def connection_options(config: ServiceBase) -> list[tuple[str, int]]:
    """Server channel arguments for a connection's life: idle and age limits, the handshake cap.

    An idle connection (no call open) is closed with GOAWAY after
    --max-connection-idle-s; every connection is sent GOAWAY after
    --max-connection-age-s, and its open calls get --max-connection-age-grace-s
    to finish. A client that connects and never completes the TLS and HTTP/2
    handshake (no SETTINGS frame) is dropped after --handshake-timeout-s
    (gRPC's default: 120 s). The age defaults to off on draft and target: their
    one client, the coordinator, holds a round stream per replica for its whole
    life, and an age would cut it (failing the rounds in flight) every period.
    """
    age_s = config.max_connection_age_s
    if age_s == -1:
        age_s = 0.0 if isinstance(config, ModelServiceBase) else PUBLIC_MAX_CONNECTION_AGE_S
    options = [("grpc.server_handshake_timeout_ms", _ms(config.handshake_timeout_s))]
    if config.max_connection_idle_s > 0:  # 0: never (gRPC's default)
        options.append(("grpc.max_connection_idle_ms", _ms(config.max_connection_idle_s)))
    if age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(age_s)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace_s)))
    return options


def _ms(seconds: float) -> int:
    """Seconds as gRPC's int milliseconds, at least 1 (validate bounds them above)."""
    return max(1, round(seconds * 1000))


def message_limit_for_context(max_context: int) -> int:
    """An internal service's receive limit: a whole context of token IDs (<= 5 bytes each) plus room.

    The verify messages' q (K x W entries, about 9 bytes each) must fit too: see the target.
    """
    return 256 * 1024 + 8 * max_context


class BoundedHealthServicer(health_aio.HealthServicer):
    """gRPC health whose `Watch` serves only the names this server reports.

    The stock servicer keeps a watcher, keyed by the requested name, for as long as
    the stream lasts, for any name: many streams with huge names hold memory. Here an
    unknown name gets SERVICE_UNKNOWN once and the stream ends (the names are fixed at
    start, so it could never become known).
    """

    def __init__(self, known: Sequence[str]) -> None:
        super().__init__()
        self._known = frozenset(known)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if request.service not in self._known:
            await context.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))
            return
        await super().Watch(request, context)


@dataclass
class ServiceHandle:
    """A started server and what shutting it down gracefully needs."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    service_names: Sequence[str]
    on_stop: Callable[[], Awaitable[None] | None] | None = None  # frees what the service holds
    on_drain: Callable[[], None] | None = None  # ends long-lived streams once they are idle

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, let in-flight calls finish for grace_s, then stop.

        A round stream is one long call that never finishes by itself: on_drain
        ends each one once its sessions are closed and answered, so an idle
        service exits at once and a busy one when its last request is done
        (grace_s still bounds it)."""
        await self.health.enter_graceful_shutdown()
        if self.on_drain is not None:
            self.on_drain()
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
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """A grpc.aio server with the services, health and reflection; bound, not started.

    Limits: messages up to max_message_bytes, at most config.max_concurrent_rpcs calls
    at once (more get RESOURCE_EXHAUSTED at once), config.max_streams_per_connection
    streams on one connection, and each connection's idle, age and handshake
    limits (connection_options).
    """
    if config.client_names:  # mutual TLS by name: only these client certificates get in
        interceptors = [ClientNameInterceptor(config.client_names), *interceptors]
    server = grpc.aio.server(
        interceptors=[ErrorMappingInterceptor(), *interceptors],
        options=[*server_options(max_message_bytes, config.max_streams_per_connection), *connection_options(config)],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    register(server)
    health_servicer = BoundedHealthServicer(["", *service_names])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{config.host}:{config.port}"
    if config.tls_enabled:  # TLS only: a plaintext client fails the handshake
        # Re-read when the files change (cert-manager renewals): see specd.serving.reloading.
        creds = ReloadingServerCredentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        port = server.add_secure_port(address, creds.credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    return server, port, health_servicer


def run_event_loop(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """asyncio.run(main) on the loop a service's --event-loop chose.

    uvloop runs the event loop in C (libuv): every stream message costs the
    services fewer CPU microseconds on the round's critical path. "auto" takes
    it where it is installed; "asyncio" is the standard library's loop.
    """
    if choice not in ("auto", "uvloop", "asyncio"):
        raise InvalidArgument(f"--event-loop must be auto, uvloop or asyncio (got {choice!r})")
    if choice == "uvloop" and uvloop is None:
        raise InvalidArgument("--event-loop uvloop: uvloop is not installed (pip install uvloop, or use asyncio)")
    if choice != "asyncio" and uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)


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
