"""TLS / mutual TLS credentials and the bearer-token check of the public API."""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from specd.core.errors import InvalidArgument
from specd.serving.reloading import read_key_pair

log = logging.getLogger(__name__)

# Only the health Check stays open: Kubernetes gRPC probes carry no token. Health Watch
# (a stream that lives as long as the caller likes) and reflection need the token
# (grpcurl sends it to both with -H 'authorization: Bearer ...').
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
# A shorter token can be guessed; `openssl rand -hex 32` gives 64 characters.
MIN_TOKEN_CHARS = 16


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS for a client, verifying the server against `ca`; with cert/key, mutual TLS."""
    chain, private_key = read_key_pair(cert, key) if cert else (None, None)
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=private_key, certificate_chain=chain)


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(
            f"the API token in {path} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return token


class TokenSource(Protocol):
    """Where the valid API tokens come from (reloading.TokenFile)."""

    def valid(self, *, recheck: bool = False) -> Sequence[str]: ...


TOKEN_REFUSED = "missing or wrong API token: send 'authorization: Bearer <token>'"


class BearerTokenCheck:
    """Whether an `authorization` header value is `Bearer <token>` (constant-time compare).

    One check for every port that takes the API token (the gRPC interceptor below, the
    coordinator's HTTP API). token: the token, or a TokenSource giving the tokens valid now
    (reloading.TokenFile: the current one and, for a grace period after a rotation, the
    previous one). A value that matches none is compared once more after the source
    rechecked its file.
    """

    def __init__(self, token: str | TokenSource) -> None:
        self._source: TokenSource | None = None if isinstance(token, str) else token
        self._fixed = (token,) if isinstance(token, str) else ()

    def _matches(self, sent: bytes, *, recheck: bool) -> bool:
        tokens = self._fixed if self._source is None else self._source.valid(recheck=recheck)
        ok = False
        for token in tokens:  # every one compared, in constant time each
            ok |= hmac.compare_digest(sent, f"Bearer {token}".encode())
        return ok

    def allows(self, sent: bytes) -> bool:
        return self._matches(sent, recheck=False) or (self._source is not None and self._matches(sent, recheck=True))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (BearerTokenCheck)."""

    def __init__(self, token: str | TokenSource | BearerTokenCheck) -> None:
        self.check = token if isinstance(token, BearerTokenCheck) else BearerTokenCheck(token)

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
        if self.check.allows(sent):
            return await continuation(details)
        return _refusal(await continuation(details), TOKEN_REFUSED)


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


class ClientNameInterceptor(grpc.aio.ServerInterceptor):
    """Mutual TLS by name: only a client certificate that names one of `names` gets in.

    A certificate "names" a name in its subject common name or a DNS subject
    alternative name. Without this, any certificate the client CA signed (another
    service's, a test's) would do. Others get PERMISSION_DENIED before their
    handler runs or reads a message.
    """

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise InvalidArgument("ClientNameInterceptor needs at least one allowed name")
        self._names = frozenset(n.encode() for n in names)

    def allowed(self, context: grpc.aio.ServicerContext) -> bool:
        auth = context.auth_context() or {}
        presented = {*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())}
        return bool(self._names & presented)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return _guarded(handler, self.allowed)


_DENIED = "this client certificate's name is not allowed here; only the coordinator's is"


def _guarded(
    handler: grpc.RpcMethodHandler, allowed: Callable[[grpc.aio.ServicerContext], bool]
) -> grpc.RpcMethodHandler:
    """The same handler, refusing callers that `allowed` rejects (any shape, generator or not)."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(inner):

            async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if not allowed(context):
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, _DENIED)
                async for item in inner(request, context):
                    yield item

            return gen

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not allowed(context):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, _DENIED)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        return call

    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    )
    for inner, make in kinds:
        if inner is not None:
            return make(wrap(inner), handler.request_deserializer, handler.response_serializer)
    return handler
