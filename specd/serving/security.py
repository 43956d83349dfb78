"""TLS / mutual TLS credentials and the bearer-token check of the public API."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# Health and reflection stay open: Kubernetes probes and grpcurl `list` carry no token.
UNAUTHENTICATED_SERVICES = ("grpc.health.v1.Health/", "grpc.reflection.")


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for a server; with client_ca, clients must present a certificate chaining to it."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=bool(client_ca),
    )


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS for a client, verifying the server against `ca`; with cert/key, mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca),
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None,
    )


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the API token file {path} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method.lstrip("/")
        if method.startswith(UNAUTHENTICATED_SERVICES):
            return await continuation(details)
        sent = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                sent = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(sent, self._expected):
            return await continuation(details)
        return _refusal(await continuation(details), "missing or wrong API token: send 'authorization: Bearer <token>'")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that aborts with UNAUTHENTICATED."""

    async def abort_unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is not None and handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            abort_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler is not None:
        return grpc.unary_unary_rpc_method_handler(
            abort_unary, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(abort_unary)
