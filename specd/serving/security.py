"""TLS / mutual TLS credentials and the bearer-token check of the public API."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from specd.core.errors import InvalidArgument

log = logging.getLogger(__name__)

# Only the health Check stays open: Kubernetes gRPC probes carry no token. Health Watch
# (a stream that lives as long as the caller likes) and reflection need the token
# (grpcurl sends it to both with -H 'authorization: Bearer ...').
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
# A shorter token can be guessed; `openssl rand -hex 32` gives 64 characters.
MIN_TOKEN_CHARS = 16


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
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(
            f"the API token in {path} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. `openssl rand -hex 32`)"
        )
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
        if details.method in UNAUTHENTICATED_METHODS:
            return await continuation(details)
        sent = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                sent = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(sent, self._expected):
            return await continuation(details)
        return _refusal(await continuation(details), "missing or wrong API token: send 'authorization: Bearer <token>'")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler that aborts with UNAUTHENTICATED without reading the request.

    Whatever the method's shape, it is served as a stream-stream handler that never
    takes a message from its iterator: the request (up to the message limit) is never
    deserialized, so a flood of refused calls with huge messages holds no memory.
    """

    async def abort(request_iterator: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    return grpc.stream_stream_rpc_method_handler(abort)
