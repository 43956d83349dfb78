"""Server side of a round stream: requests in order, handled off the event loop.

A session belongs to the stream that opened it: each stream's session IDs live
in their own namespace of the service's session table (`StreamScope`), so
another stream (another coordinator, or anyone holding a client certificate)
can neither read nor advance nor close them, and when the stream ends its
sessions are closed at once. A coordinator that reconnects re-opens its
sessions from the committed tokens (a service that does not know a session
says so; sessions heal).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from specd.serving.batching import Answered, Deliver
from specd.v1 import session_pb2

Req = TypeVar("Req")


class TimedResponse(Protocol):
    """A round-stream response (DraftResponse, TargetResponse): it carries the service's timing."""

    @property
    def timing(self) -> session_pb2.ServiceTiming: ...


Resp = TypeVar("Resp", bound=TimedResponse)


@dataclass(slots=True)
class Stamped(Generic[Req]):
    """A stream message on its way through the service, with the times it passed each stage.

    perf_counter_ns of this process: read from the stream, its batch started and ended
    on the model thread (the batch runner sets those two); the stream turns them into
    the response's ServiceTiming when it hands the response message to gRPC. deliver:
    how to answer it (its stream's), for a message the service answers later.
    """

    request: Req
    arrived_ns: int
    started_ns: int = 0
    ended_ns: int = 0
    deliver: Deliver[Stamped[Req], Any] | None = None  # its stream's, set when it is submitted
    staged_candidate: int = 0  # a target's staged verify (1 + the candidate it runs), 0 for a stream message
    finish: Callable[[], None] | None = None  # what of its response the stream builds before sending it


SCOPE_SEPARATOR = "/"


def client_session_id(scoped: str) -> str:
    """The session ID its stream's client knows, from the service-side (scoped) one."""
    return scoped.rpartition(SCOPE_SEPARATOR)[2]


class StreamScope:
    """The session namespace of one stream, and the sessions it holds open.

    Requests and responses are the Draft/Target stream messages (a `session_id`
    field, an `op` oneof with `open` and `close`).
    """

    def __init__(self) -> None:
        self.prefix = uuid.uuid4().hex + SCOPE_SEPARATOR
        self.open: set[str] = set()  # scoped IDs this stream opened and has not closed

    def inbound(self, req: Any) -> Any:
        req.session_id = self.prefix + req.session_id
        op = req.WhichOneof("op")
        if op == "open":
            self.open.add(req.session_id)
        elif op == "close":
            self.open.discard(req.session_id)
        return req

    def outbound(self, resp: Any) -> Any:
        resp.session_id = resp.session_id.removeprefix(self.prefix)
        return resp

    def closes(self, make: Callable[[], Any]) -> list[Any]:
        """Close messages (built by `make()`, an empty request) for every session still open."""
        out = []
        for sid in sorted(self.open):
            req = make()
            req.session_id = sid
            req.close.SetInParent()
            out.append(req)
        self.open.clear()
        return out


async def serve_round_stream(
    messages: AsyncIterator[Any],
    submit: Callable[[list[Stamped[Req]], Deliver[Stamped[Req], Resp]], None],
    *,
    unpack: Callable[[Any], Iterable[Req]],
    pack: Callable[[list[Resp]], Any],
    max_pending: int = 256,
    scope: StreamScope | None = None,
    make_request: Callable[[], Req] | None = None,
    drain: asyncio.Event | None = None,
) -> AsyncIterator[Any]:
    """Hand each stream message's requests to `submit` (the model thread's batcher); yield their answers.

    messages: the stream's incoming messages, each holding one or more requests
    (`unpack`); what comes back for them is one outgoing message per delivery
    (`pack`): the answers of one model-thread batch, however many requests of
    this stream it ran. Each request goes in stamped with its arrival; each
    response comes out with its ServiceTiming filled in (queued, batch, reply),
    so the caller can split its round trip.

    At most max_pending requests wait at once; beyond that the stream stops
    reading, so gRPC flow control pushes back on the sender (no unbounded queue).
    Written as an async generator (the OpenTelemetry aio instrumentor needs it).
    scope (with make_request, an empty request): the stream's own session
    namespace; its open sessions are closed when the stream ends, however it ends.
    drain: once set (the service is shutting down), the stream ends as soon as it is
    idle: no session of it open and every request it has read answered. The
    requests in flight finish their rounds here, and an idle service exits at
    once instead of after the whole shutdown grace (which still bounds a busy one).
    """
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue[Answered[Stamped[Req], Resp] | None] = asyncio.Queue()  # bounded by max_pending
    room = asyncio.Event()
    room.set()
    clock = time.perf_counter_ns
    unanswered = 0  # requests read and not yet answered
    reading = True

    def idle() -> bool:
        return unanswered == 0 and (scope is None or not scope.open)

    def deliver(answered: Answered[Stamped[Req], Resp]) -> None:  # any thread: one loop wake-up per delivery
        loop.call_soon_threadsafe(answers.put_nowait, answered)

    async def read() -> None:
        nonlocal unanswered, reading
        try:
            async for message in messages:
                now = clock()
                items = [
                    Stamped(scope.inbound(r) if scope is not None else r, now, deliver=deliver) for r in unpack(message)
                ]
                unanswered += len(items)
                if unanswered >= max_pending:
                    room.clear()
                submit(items, deliver)
                await room.wait()
        finally:
            reading = False
            if unanswered == 0:
                answers.put_nowait(None)

    reader = asyncio.create_task(read())

    async def end_when_idle(event: asyncio.Event) -> None:
        await event.wait()
        if idle():
            reader.cancel()  # idle now; otherwise the loop below ends it after its last answer

    stopper = asyncio.create_task(end_when_idle(drain)) if drain is not None else None
    try:
        while (answered := await answers.get()) is not None:
            now = clock()
            responses: list[Resp] = []
            for stamped, result in answered:
                if isinstance(result, BaseException):
                    raise result  # the batch itself failed (a bug): the stream ends, its sessions heal
                if stamped.finish is not None:  # built here, off the model thread (late_fill)
                    stamped.finish()
                    stamped.finish = None
                    now = clock()
                _fill_timing(result.timing, stamped, now)
                responses.append(scope.outbound(result) if scope is not None else result)
            unanswered -= len(answered)
            if unanswered < max_pending:
                room.set()
            yield pack(responses)
            if drain is not None and drain.is_set() and idle():
                reader.cancel()  # its last session closed and answered: the stream ends
            if not reading and unanswered == 0:
                break
        if not reader.cancelled():  # cancelled: drained, the stream ends cleanly
            await reader  # re-raise a broken stream's error, if any
    finally:
        reader.cancel()
        if stopper is not None:
            stopper.cancel()
        if scope is not None and make_request is not None:
            closes = [Stamped(close, clock()) for close in scope.closes(make_request)]
            submit(closes, _ignore)  # frees their KV now; nobody waits for the answers


def _ignore(answered: Answered[Any, Any]) -> None:
    """The answers to a closed stream's final closes: nobody waits for them."""


def _fill_timing(timing: session_pb2.ServiceTiming, stamped: Stamped[Any], now_ns: int) -> None:
    """queued / batch / reply in microseconds (0 for a stage a message skipped)."""
    if not stamped.started_ns:
        return
    timing.queued_us = max(0, stamped.started_ns - stamped.arrived_ns) // 1000
    timing.batch_us = max(0, stamped.ended_ns - stamped.started_ns) // 1000
    timing.reply_us = max(0, now_ns - stamped.ended_ns) // 1000
