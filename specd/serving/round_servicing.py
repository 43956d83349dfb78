"""The draft and target servicers' common body: batches of stream messages, open/close, spans, metrics.

A stream message carries requests (open, a step, close) of any of the stream's
sessions; each becomes a request for the model thread's MicroBatcher, and the
answers of one model-thread batch go back as one stream message. A batch is
walked in arrival order: step messages
(draft `propose`, target `verify`) of different sessions are gathered and run
as one batched core call; any other message runs on its own, after the
gathered steps of its session (so a session's messages keep their order).

Each message that carries a trace context gets a span under its round, with
one child span per phase of the core step (sync, forward, sampling,
rollback; see specd.core.phases) at the times they really ran. A batch's
spans and metrics are recorded after its answers went out (the batcher's
after_deliver), or, when the next batch is already queued, beside that
batch's forward pass (a subclass hands `record_answered` to its core as the
pass's `beside`): recording no longer holds a verdict back, nor a staged
verify's pass (emulated h100-tp2-70b, fixed K = 4, one stream: round
overhead p50 5.7 -> 5.4 ms; docs/performance.md).

A servicer subclass names its messages and spans and supplies the parts
that differ: how a step message becomes a core request (and its result a
response), how a session opens, and what a step counts in the metrics.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence, Sized
from concurrent.futures import Executor
from typing import Any, Generic, Protocol, TypeVar

from specd.core.errors import InvalidArgument, SessionNotFound
from specd.core.phases import PhaseLog
from specd.serving import trace_names, trace_spans
from specd.serving import tracing as tr
from specd.serving.batching import LATER, Deliver, Later, MicroBatcher
from specd.serving.grpc_errors import session_error
from specd.serving.streams import Stamped, StreamScope, TimedResponse, client_session_id, serve_round_stream
from specd.v1 import common_pb2, session_pb2

Resp = TypeVar("Resp", bound=TimedResponse)
Work = TypeVar("Work")  # a step message as the core's request (ProposeRequest, VerifyRequest)
Result = TypeVar("Result")  # the core's answer to one (Proposal, VerifyOutcome)
Handled = tuple[Any, PhaseLog | None]  # (response message, where the core's time went)
# A message handled, its span and metrics not recorded yet: (request, response, span, phases).
Unrecorded = tuple[Any, Any, "tr.Span | None", PhaseLog | None]

log = logging.getLogger(__name__)


class _OpenOp(Protocol):
    @property
    def token_ids(self) -> Sized: ...


class RoundRequest(Protocol):
    """What the servicer reads on every stream message (DraftRequest, TargetRequest)."""

    request_id: int
    session_id: str
    committed_length: int

    @property
    def open(self) -> _OpenOp: ...

    def WhichOneof(self, oneof_group: Any) -> Any: ...  # as protobuf's Message types it


Req = TypeVar("Req", bound=RoundRequest)  # the stream's request message


class SessionEngine(Protocol):
    """What the servicer itself calls on its core engine (a drafter or the verifier)."""

    def close(self, session_id: str) -> None: ...

    def active_sessions(self) -> int: ...


class BatchedRoundServicer(abc.ABC, Generic[Req, Resp, Work, Result]):
    """Base of DraftServicer and TargetServicer: the Rounds stream and GetModelInfo over a core engine."""

    step_op: str  # the batchable oneof case: "propose" | "verify"
    extra_step_ops: frozenset[str] = frozenset()  # other oneof cases batched with it (the draft's "branches")
    span_prefix: str  # "specd.draft." | "specd.target.": + the oneof case (open, step, close) or the phase name
    request_type: Callable[..., Req]  # one request (DraftRequest, TargetRequest)
    response_type: Callable[..., Resp]  # one response
    responses_type: Callable[..., Any]  # a stream message of responses (DraftResponses, TargetResponses)

    def __init__(
        self,
        engine: SessionEngine,
        executor: Executor,
        info: common_pb2.ModelInfo,
        *,
        tracing: tr.Tracing | None = None,
        metrics: Any = None,  # DraftMetrics | TargetMetrics
        max_batch: int = 32,
        batch_wait_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.info = info
        self.draining = asyncio.Event()  # set on shutdown: each stream ends once its sessions are closed
        self.tracing = tracing or tr.TRACING_OFF
        self.metrics = metrics
        # Sessions whose close has arrived but not run yet: their messages still ahead of the close
        # (in a batch the model thread already took) are answered unrun too. Scoped IDs, never reused.
        self._closing: set[str] = set()
        self._closing_lock = threading.Lock()
        self.batcher: MicroBatcher[Stamped[Req], Resp] = MicroBatcher(
            self.handle_stamped,
            executor,
            max_batch=max_batch,
            max_wait_s=batch_wait_s,
            expected=engine.active_sessions,
            after_deliver=self._after_deliver,
        )
        # answered messages whose spans and metrics wait, with when they were answered (ns since the epoch)
        self._unrecorded: list[tuple[Unrecorded, int]] = []  # model thread only
        if metrics is not None:
            metrics.watch_sessions(engine.active_sessions, getattr(engine, "kv_bytes", None))  # NgramDrafter has none

    # ---- what a subclass provides --------------------------------------------------

    @abc.abstractmethod
    def step_request(self, request: Req) -> Work:
        """A step message as the core's request; raises for a message that is wrong on its own."""

    @abc.abstractmethod
    def run_step_batch(self, work: Sequence[Work]) -> Sequence[Result | Exception]:
        """The core's batched step: one result or error per request."""

    @abc.abstractmethod
    def fill_step(self, response: Resp, result: Result) -> PhaseLog:
        """Put a step's result in its response; return where the core's time went."""

    def late_fill(self, response: Resp, result: Result) -> Callable[[], None] | None:
        """The part of a step's response the stream builds, off the model thread (the draft's q rows), or None.

        Run by the stream's event loop just before the response is sent (Stamped.finish), so the
        model thread goes on to its next batch meanwhile; run at once where no stream sends it.
        """
        return None

    @abc.abstractmethod
    def open_session(self, request: Req) -> None:
        """An open message: its own checks, then the engine's open."""

    @abc.abstractmethod
    def observe_step(self, request: Req, response: Resp, batch_size: int) -> dict[str, Any]:
        """Count a successful step in the metrics; return its span attributes."""

    def close_session(self, request: Req) -> None:
        """A close message: the engine forgets the session (a service may learn from it first)."""
        self.engine.close(request.session_id)

    # ---- one message ------------------------------------------------------------------

    def _empty_request(self) -> Req:
        """An empty request message of this service (the stream closes its sessions with it)."""
        return self.request_type()

    def _response(self, req: Any) -> Resp:
        """An empty response addressed to `req` (request id, session, committed length)."""
        return self.response_type(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )

    def run_steps(self, requests: Sequence[Req], late: dict[int, Callable[[], None]] | None = None) -> list[Handled]:
        """Step messages of different sessions: one batched core call (model thread).

        late: where each response's late_fill goes, by its index in `requests` (the stream runs
        them); None: they run here, and the responses come back whole.
        """
        out: list[Handled | None] = [None] * len(requests)
        work: list[tuple[int, Work]] = []
        for i, req in enumerate(requests):
            try:
                work.append((i, self.step_request(req)))
            except Exception as exc:  # noqa: BLE001 - this message's error, in-band
                out[i] = (self._error(req, exc), None)
        results = self.run_step_batch([w for _, w in work]) if work else []
        for (i, _), result in zip(work, results):
            if isinstance(result, Exception):
                out[i] = (self._error(requests[i], result), None)
            else:
                resp = self._response(requests[i])
                out[i] = (resp, self.fill_step(resp, result))
                fill = self.late_fill(resp, result)
                if fill is not None:
                    fill = self._guarded(requests[i], resp, fill)
                    if late is None:
                        fill()
                    else:
                        late[i] = fill
        handled = [h for h in out if h is not None]
        if len(handled) != len(requests):
            raise RuntimeError(f"the core answered {len(results)} of {len(work)} {self.step_op} requests")
        return handled

    def run_other(self, req: Req) -> Resp:
        """open / close (or a message with no op), on its own: per-session errors go back in-band."""
        resp: Any = self._response(req)
        try:
            op = req.WhichOneof("op")
            if op == "open":
                if len(req.open.token_ids) != req.committed_length:
                    raise InvalidArgument("open: committed_length must equal the number of token_ids")
                self.open_session(req)
                resp.ack.SetInParent()
            elif op == "close":
                with self._closing_lock:
                    self._closing.discard(req.session_id)
                self.close_session(req)
                resp.ack.SetInParent()
            else:
                name = type(req).__name__
                raise InvalidArgument(f"{name} needs one of open, {self.step_op}, close")
        except Exception as exc:  # noqa: BLE001 - reported in-band; internals logged by session_error
            resp.error.CopyFrom(session_error(exc))
        return resp

    # ---- the batch walk ---------------------------------------------------------------

    def handle_stamped(self, items: Sequence[Stamped[Req]]) -> list[Resp | Later]:
        """handle_batch for messages off the stream, noting when their batch started and ended.

        A subclass may keep some messages to answer later (`hold`; LATER in their place) and
        look at the batch's answers (`after_batch`)."""
        started = time.perf_counter_ns()
        held = self.hold(items)
        run = [item for item in items if id(item) not in held] if held else list(items)
        late: dict[int, Callable[[], None]] = {}
        fresh: list[Unrecorded] = []
        out = self.handle_batch([item.request for item in run], late, unrecorded=fresh)
        for i, fill in late.items():
            run[i].finish = fill
        self.after_batch(run, out)
        ended = time.perf_counter_ns()
        for item in items:
            item.started_ns, item.ended_ns = started, ended
        self.record_answered()  # an earlier batch's that no pass of this one took
        answered = time.time_ns()  # the spans' clock
        self._unrecorded = [(u, answered) for u in fresh]
        if not held:
            return list(out)
        answers = iter(out)
        return [LATER if id(item) in held else next(answers) for item in items]

    def hold(self, items: Sequence[Stamped[Req]]) -> set[int]:
        """The messages (by id) this service keeps, to answer through their Deliver later (model thread)."""
        return set()

    def after_batch(self, items: Sequence[Stamped[Req]], responses: Sequence[Resp]) -> None:
        """Sees each message the batch ran, with its response (model thread)."""

    def record_answered(self) -> None:
        """The spans and metrics of the messages answered so far (model thread; beside a pass, or after the
        answers went out)."""
        pending, self._unrecorded = self._unrecorded, []
        for (req, resp, span, phases), answered_ns in pending:
            try:
                self._finish(req, resp, span, phases, answered_ns)
            except Exception:
                log.exception("recording a %s message failed", self.step_op)

    def _after_deliver(self, queued: bool) -> None:
        """After a batch's answers went out: record them now, unless a batch is queued to run them beside its pass."""
        if not queued:
            self.record_answered()

    def handle_batch(
        self,
        requests: Sequence[Req],
        late: dict[int, Callable[[], None]] | None = None,
        *,
        unrecorded: list[Unrecorded] | None = None,
    ) -> list[Resp]:
        """One model-thread batch of stream messages -> their responses (late: as in run_steps).

        unrecorded: where each message's span and metrics go to be recorded later (record_answered);
        None: recorded here."""
        spans = [self._start_span(r) for r in requests]
        handled: list[Handled | None] = [None] * len(requests)
        group: list[int] = []  # indices of gathered step messages
        sessions: set[str] = set()

        def flush() -> None:
            if group:
                fills: dict[int, Callable[[], None]] | None = None if late is None else {}
                try:
                    results = self.run_steps([requests[i] for i in group], fills)
                except Exception as exc:  # noqa: BLE001 - a bug in the batch path must not break the stream
                    results, fills = [(self._error(requests[i], exc), None) for i in group], None
                if late is not None and fills:
                    late.update((group[j], fill) for j, fill in fills.items())
                for i, h in zip(group, results):
                    handled[i] = h
            group.clear()
            sessions.clear()

        for i, req in enumerate(requests):
            sid = req.session_id
            op = req.WhichOneof("op")
            if op != "close" and self._is_closing(sid):  # abandoned while queued: no one waits for it
                handled[i] = (self._withdrawn(req), None)
                continue
            if sid in sessions:  # this session's earlier step must run first
                flush()
            if self._is_step(op):
                group.append(i)
                sessions.add(sid)
            else:
                handled[i] = (self.run_other(req), None)
        flush()
        out: list[Resp] = []
        for req, span, h in zip(requests, spans, handled):
            assert h is not None
            resp, phases = h
            out.append(resp)
            if unrecorded is not None:
                unrecorded.append((req, resp, span, phases))
                continue
            try:
                self._finish(req, resp, span, phases)
            except Exception:
                log.exception("recording a %s message failed", self.step_op)
        return out

    def _is_step(self, op: str | None) -> bool:
        return op == self.step_op or op in self.extra_step_ops

    def _guarded(self, req: Any, resp: Any, fill: Callable[[], None]) -> Callable[[], None]:
        """`fill`, whose failure answers the message in-band with the error (as a failing step would)."""

        def run() -> None:
            try:
                fill()
            except Exception as exc:  # noqa: BLE001 - this message's error, in-band; logged by session_error
                resp.CopyFrom(self._error(req, exc))

        return run

    def _error(self, req: Any, exc: BaseException) -> Any:
        resp: Any = self._response(req)
        resp.error.CopyFrom(session_error(exc))
        return resp

    # ---- spans and metrics ------------------------------------------------------------

    def _start_span(self, req: Any) -> tr.Span | None:
        if not req.trace_context:
            return None
        op = req.WhichOneof("op") or "none"
        return self.tracing.start_remote_child(
            self.span_prefix + (op if op in ("open", "close") or self._is_step(op) else self.step_op),
            req.trace_context,
            {
                trace_names.ATTR_SESSION_ID: trace_spans.hashed_session_id(client_session_id(req.session_id)),
                trace_names.ATTR_COMMITTED_LENGTH: req.committed_length,
            },
        )

    def _finish(
        self, req: Any, resp: Any, span: tr.Span | None, phases: PhaseLog | None, answered_ns: int | None = None
    ) -> None:
        """A message's span (ended when it was answered: answered_ns since the epoch; None: now) and metrics."""
        if span is None and self.metrics is None:
            return
        op = req.WhichOneof("op") or "none"
        error = None
        if resp.WhichOneof("result") == "error":
            error = (
                session_pb2.SessionError.Code.Name(resp.error.code).removeprefix("CODE_").lower(),
                resp.error.message,
            )
        attributes = None
        if self._is_step(op) and error is None:  # a successful step always carries its phases
            attributes = self.observe_step(req, resp, phases.batch_size if phases is not None else 1)
        if span is not None and phases is not None and span.is_recording():
            for p in phases.merged():
                child = self.tracing.start_span(
                    self.span_prefix + p.name,
                    span,
                    start_time=phases.epoch_ns(p.start_ns),
                    attributes={trace_names.ATTR_PHASE_MS: round(phases.total_ms(p.name), 3)},
                )
                child.end(end_time=phases.epoch_ns(p.end_ns))
        trace_spans.end_message_span(span, attributes, error, answered_ns)
        if self.metrics is not None:
            self.metrics.observe_message(op, "ok" if error is None else error[0])

    # ---- the gRPC methods ------------------------------------------------------------------

    async def Rounds(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        # Headers first, so the coordinator knows the stream is up before any round.
        await context.send_initial_metadata(())
        # Sessions belong to this stream (their own namespace), and close with it.
        scope = StreamScope()
        async for message in serve_round_stream(
            request_iterator,
            self._submit,
            unpack=_requests_of,
            pack=self._pack,
            scope=scope,
            make_request=self._empty_request,
            drain=self.draining,
        ):
            yield message

    def _pack(self, responses: list[Resp]) -> Any:
        return self.responses_type(responses=responses)

    def _submit(self, items: list[Stamped[Req]], deliver: Deliver[Stamped[Req], Resp]) -> None:
        """Queue a stream message's requests for the model thread; a close first withdraws its session's queued messages.

        The coordinator closes a session when its request is over (finished, cancelled or
        expired): an open or step of it still queued has no one waiting, so it never runs and
        is answered at once. The session's scoped ID names it within this stream only.
        """
        for stamped in items:
            req = stamped.request
            if req.WhichOneof("op") != "close":
                continue
            sid = req.session_id
            with self._closing_lock:
                self._closing.add(sid)
            withdrawn = self.batcher.withdraw(_queued_work_of(sid), lambda s: self._withdrawn(s.request))
            if withdrawn:
                log.debug("session %s closed: %d queued messages withdrawn unrun", client_session_id(sid), withdrawn)
        self.batcher.submit(items, deliver)

    def _is_closing(self, sid: str) -> bool:
        with self._closing_lock:
            return sid in self._closing

    def _withdrawn(self, req: Req) -> Resp:
        resp = self._error(req, SessionNotFound("the session closed before this message ran; it was not run"))
        if self.metrics is not None:
            self.metrics.observe_message(req.WhichOneof("op") or "none", "withdrawn")
        return resp

    def drain(self) -> None:
        """Shutting down: every round stream ends as soon as it has no open session and nothing unanswered."""
        self.draining.set()

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest, context: Any) -> common_pb2.ModelInfo:
        return self.info


def _queued_work_of(sid: str) -> Callable[[Stamped[Any]], bool]:
    """Matches a session's queued messages other than its close (what a close withdraws)."""
    return lambda s: s.request.session_id == sid and s.request.WhichOneof("op") != "close"


def _requests_of(message: Any) -> Any:
    """The requests a stream message carries (DraftRequests, TargetRequests)."""
    return message.requests
