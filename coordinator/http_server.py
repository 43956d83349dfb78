"""The coordinator's OpenAI-compatible HTTP API: a Starlette app on uvicorn, in the coordinator's event loop.

Thin: a body is translated (coordinator.openai_api) into the GenerateRequest a
gRPC caller would send and run through the same call (coordinator.calls: size
caps, admission, deadline, span, metrics) on the same engine. Around it, what
HTTP needs:

- the API token: `Authorization: Bearer <token>`, the same TokenFile and
  constant-time check as the gRPC port (security.BearerTokenCheck), before the
  body is read; /health needs none (probes carry no token);
- the body limit: Content-Length, then the bytes read, against
  requests.public_body_limit (413 before parsing);
- the caller gone: a client that disconnects cancels its request (the engine
  closes its sessions at the draft and the target). Non-streaming: the call
  runs in a task raced against the connection's http.disconnect; streaming:
  the first chunk the same way (so errors before it get their real status),
  then the event stream, raced against the disconnect the same way;
- errors: OpenAI's JSON shape, the status from the one mapper
  (grpc_errors.http_status_for); internals logged, never sent;
- TLS: the coordinator's --tls-cert/--tls-key (re-read when they change),
  --tls-client-ca requires a client certificate. The tenant identity is the
  token's ('api-token') or none: the HTTP port does not read certificate names.

uvicorn runs as a task (`OpenAIServer.start`): no thread, no loop of its own,
no signal handlers and no logging set-up of its own (the service has both).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from coordinator import openai_api as oa
from coordinator.calls import generate_chunks
from coordinator.engine import Chunk, RoundEngine
from coordinator.requests import public_body_limit
from specd.serving.config import CoordinatorConfig
from specd.serving.grpc_errors import http_status_for
from specd.serving.reloading import CHECK_INTERVAL_S, FileWatch, read_key_pair
from specd.serving.security import TOKEN_REFUSED, BearerTokenCheck
from specd.serving.tenancy import TOKEN_IDENTITY

log = logging.getLogger(__name__)
T = TypeVar("T")

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy buffering of the stream
_TRACE_HEADERS = ("traceparent", "tracestate")


class _Disconnected(Exception):
    """The client closed its connection before the answer was ready."""


class _TooLarge(Exception):
    pass


def _json_error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"connection": "close"} if status == 413 else None  # the rest of the body is not read
    return JSONResponse(oa.error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def _error_response(exc: BaseException) -> JSONResponse:
    status, code, message = http_status_for(exc)  # logs internals; the message is client-safe
    return _json_error(status, message, param=getattr(exc, "param", None), code=code.name.lower())


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events, cancelled once when the client goes, and their generator closed at the end.

    Starlette's StreamingResponse watches for the disconnect in an anyio task group, whose
    cancellation is delivered again at every await until the scope exits: the request's own
    clean-up (closing its sessions at the peers) would be cut short. Here the send runs in a
    task that is cancelled once, as a gRPC cancellation is, and the generator is closed however
    the response ended (it may be suspended at a yield, holding the request open)."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((sending, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not sending.done():
                sending.cancel()
            try:
                await sending
            except asyncio.CancelledError:
                pass
            except OSError:  # the connection broke mid-send
                pass
            finally:
                await self._events.aclose()


async def _wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (after the body was read, receive() gives only that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """work's result; if the client goes first, work is cancelled and _Disconnected raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # the request's clean-up (sessions closed, metrics) runs before we return
        raise _Disconnected
    return task.result()


class OpenAIApp:
    """The routes over one engine; `app` is the ASGI application."""

    def __init__(self, engine: RoundEngine, config: CoordinatorConfig, tokens: BearerTokenCheck | None) -> None:
        self.engine = engine
        self.config = config
        self.tokens = tokens
        self.identity = TOKEN_IDENTITY if tokens is not None else ""
        self.started = int(time.time())
        self.draining = False
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    @property
    def model_names(self) -> list[str]:
        info = self.engine.target_info
        return self.config.served_model_names or [info.name if info is not None else "specd"]

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return _json_error(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found")
        return _json_error(exc.status_code, str(exc.detail), code="http_error")

    def _refused(self, request: Request) -> JSONResponse | None:
        if self.tokens is None:
            return None
        sent = request.headers.get("authorization", "").encode("latin-1")
        if self.tokens.allows(sent):
            return None
        return _json_error(401, TOKEN_REFUSED, code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        limit = public_body_limit(self.config, self.engine.max_context)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _TooLarge(limit)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise _TooLarge(limit)
            parts.append(part)
        try:
            return json.loads(b"".join(parts))
        except (ValueError, RecursionError) as exc:
            raise oa.BadParam(f"the request body is not valid JSON ({type(exc).__name__})") from None

    # ---- routes ----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.draining:
            return _json_error(503, "shutting down", code="unavailable")
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse(oa.models_list(self.model_names, created=self.started, max_context=self.engine.max_context))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, oa.parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, oa.parse_chat)

    async def _generate(self, request: Request, parse: Callable[[Any, list[str]], oa.OpenAIRequest]) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            parsed = parse(await self._body(request), self.model_names)
        except _TooLarge as exc:
            return _json_error(
                413, f"the request body exceeds {exc.args[0]} bytes; send a shorter prompt", code="too_large"
            )
        except Exception as exc:  # noqa: BLE001 - mapped (and logged if internal) by the one mapper
            return _error_response(exc)
        carrier = [(k, v) for k in _TRACE_HEADERS if (v := request.headers.get(k)) is not None]
        chunks = generate_chunks(
            self.engine,
            "GenerateStream" if parsed.stream else "Generate",
            parsed.request,
            remaining=None,  # HTTP carries no deadline: --request-timeout-s
            identity=self.identity,
            trace_carrier=carrier,
            span_attributes={"http.request.method": "POST", "http.route": request.url.path},
        )
        try:
            if parsed.stream:
                return await self._stream(request, parsed, chunks)
            return await self._whole(request, parsed, chunks)
        except _Disconnected:
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except Exception as exc:  # noqa: BLE001 - mapped (and logged if internal) by the one mapper
            return _error_response(exc)

    async def _whole(self, request: Request, parsed: oa.OpenAIRequest, chunks: AsyncGenerator[Chunk, None]) -> Response:
        async def collect() -> oa.Completion:
            done = oa.Completion()
            async for chunk in chunks:
                done.add(chunk)
            return done

        return JSONResponse(oa.response(parsed, await _unless_disconnected(request, collect())))

    async def _stream(
        self, request: Request, parsed: oa.OpenAIRequest, chunks: AsyncGenerator[Chunk, None]
    ) -> Response:
        # The first chunk before the headers: a refusal (bad value, admission) gets its real status.
        first = await _unless_disconnected(request, anext(chunks, None))

        async def events() -> AsyncGenerator[bytes, None]:
            stats = None
            try:
                if (opening := oa.stream_chunk(parsed, None, first=True)) is not None:
                    yield _sse(opening)
                chunk = first
                while chunk is not None:
                    if chunk.stats is not None:
                        stats = chunk.stats
                    if (event := oa.stream_chunk(parsed, chunk)) is not None:
                        yield _sse(event)
                    chunk = await anext(chunks, None)  # the request's clean-up runs before [DONE]
            except Exception as exc:  # noqa: BLE001 - after the headers, an error goes in-band
                status, code, message = http_status_for(exc)
                yield _sse(oa.error_body(status, message, code=code.name.lower()))
            else:
                if parsed.include_usage and stats is not None:
                    yield _sse(oa.usage_chunk(parsed, stats))
            finally:
                await chunks.aclose()  # at once, wherever the stream stopped
            yield b"data: [DONE]\n\n"

        return _EventStream(events())


# ---- the server ------------------------------------------------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    """uvicorn as one task of a running service: the service owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _ReloadingTLS:
    """An SSLContext for the HTTP port whose certificate follows its files (cert-manager renewals).

    Checked once a second by the server's task; a new pair is taken for the handshakes after
    it, connections already open keep theirs. A half-written pair keeps the current one."""

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self.cert, self.key = cert, key
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.set_alpn_protocols(["http/1.1"])
        self.context.load_cert_chain(cert, key)
        if client_ca:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
        self.watch = FileWatch([cert, key])
        self.reloads = 0

    def check(self) -> None:
        if not self.watch.changed():
            return
        try:
            read_key_pair(self.cert, self.key)  # both files present and matching
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS files changed but could not be read (%s); keeping the current certificate", exc)
            return
        self.reloads += 1
        log.info("HTTP port: TLS certificate reloaded from %s", self.cert)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


class OpenAIServer:
    """The HTTP API, bound at start; `port` is the one it got (--http-port 0 picks one)."""

    def __init__(self, engine: RoundEngine, config: CoordinatorConfig, tokens: BearerTokenCheck | None) -> None:
        self.config = config
        self.api = OpenAIApp(engine, config, tokens)
        self.tls = _ReloadingTLS(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_enabled else None
        tls = self.tls
        self._server = _EmbeddedServer(
            uvicorn.Config(
                self.api.app,
                lifespan="off",
                log_config=None,  # the service configured logging
                access_log=False,
                proxy_headers=False,
                server_header=False,
                ws="none",
                limit_concurrency=config.max_concurrent_rpcs,  # connections + requests; more get 503
                timeout_keep_alive=5,
                timeout_graceful_shutdown=max(1, round(config.grace_s)),
                ssl_context_factory=(lambda _config, _default: tls.context) if tls is not None else None,
            )
        )
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._tls_task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    async def start(self) -> int:
        self._socket = _bind(self.config.host, self.config.http_port)
        self.port = self._socket.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="specd-openai-http")
        while not self._server.started:  # bound already; serving within a loop turn or two
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if self.tls is not None:
            self._tls_task = asyncio.create_task(self._watch_tls(), name="specd-openai-tls")
        return self.port

    async def _watch_tls(self) -> None:
        assert self.tls is not None
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            self.tls.check()

    def begin_shutdown(self) -> None:
        """Stop taking connections (/health answers 503 meanwhile); requests in flight go on."""
        self.api.draining = True
        self._server.should_exit = True

    async def stop(self) -> None:
        """Shut down: in-flight requests get --grace-s, then they are cancelled."""
        self.begin_shutdown()
        if self._tls_task is not None:
            self._tls_task.cancel()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.config.grace_s + 5.0)
            except TimeoutError:
                self._task.cancel()
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                log.warning("HTTP server stopped with an error: %s", exc)
        if self._socket is not None:
            self._socket.close()
