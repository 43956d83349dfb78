"""What the draft and target servicers share: batches of stream messages, spans, metrics.

Each stream message (open, a step, close) becomes a request for the model
thread's MicroBatcher. A batch is walked in arrival order: step messages
(draft `propose`, target `verify`) of different sessions are gathered and run
as one batched core call; any other message runs on its own, after the
gathered steps of its session (so a session's messages keep their order).

Each message that carries a trace context gets a span under its round, with
one child span per phase of the core step (sync, forward, sampling,
rollback; see specd.core.phases) at the times they really ran.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

from specd.core.phases import PhaseLog
from specd.serving import tracing as tr
from specd.serving.batching import MicroBatcher
from specd.serving.grpc_errors import session_error
from specd.serving.streams import StreamSessions, client_session_id, serve_round_stream
from specd.v1 import session_pb2

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handled = tuple[Any, PhaseLog | None]  # (response message, where the core's time went)

log = logging.getLogger(__name__)


class BatchedRoundServicer(abc.ABC, Generic[Req, Resp]):
    """Base of DraftServicer and TargetServicer (they add the gRPC methods and the core calls)."""

    step_op: str  # the batchable oneof case: "propose" | "verify"
    span_names: Mapping[str, str]  # oneof case -> span name
    phase_span_prefix: str  # "specd.draft." | "specd.target."

    def __init__(
        self,
        executor: Executor,
        *,
        tracing: tr.Tracing | None,
        metrics: Any,
        max_batch: int,
        batch_wait_s: float = 0.0,
        active_sessions: Callable[[], int] | None = None,
    ) -> None:
        self.tracing = tracing or tr.TRACING_OFF
        self.metrics = metrics
        self.batcher: MicroBatcher[Req, Resp] = MicroBatcher(
            self.handle_batch, executor, max_batch=max_batch, max_wait_s=batch_wait_s, expected=active_sessions
        )

    # ---- what a subclass provides --------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def _empty_request() -> Any:
        """An empty request message of this service (the stream closes its sessions with it)."""

    @staticmethod
    @abc.abstractmethod
    def _response(request: Any) -> Any:
        """An empty response addressed to `request` (request id, session, committed length)."""

    @abc.abstractmethod
    def run_steps(self, requests: Sequence[Req]) -> list[Handled]:
        """The step messages of different sessions as one batched core call."""

    @abc.abstractmethod
    def run_other(self, request: Req) -> Resp:
        """Any other message (open, close, unknown), on its own."""

    @abc.abstractmethod
    def observe_step(self, request: Req, response: Resp, batch_size: int) -> dict[str, Any]:
        """Count a successful step in the metrics; return its span attributes."""

    # ---- the batch walk ---------------------------------------------------------------

    def handle_batch(self, requests: Sequence[Req]) -> list[Resp]:
        spans = [self._start_span(r) for r in requests]
        handled: list[Handled | None] = [None] * len(requests)
        group: list[int] = []  # indices of gathered step messages
        sessions: set[str] = set()

        def flush() -> None:
            if group:
                try:
                    results = self.run_steps([requests[i] for i in group])
                except Exception as exc:  # noqa: BLE001 - a bug in the batch path must not break the stream
                    results = [(self._error(requests[i], exc), None) for i in group]
                for i, h in zip(group, results):
                    handled[i] = h
            group.clear()
            sessions.clear()

        for i, req in enumerate(requests):
            sid = req.session_id  # type: ignore[attr-defined]
            if sid in sessions:  # this session's earlier step must run first
                flush()
            if req.WhichOneof("op") == self.step_op:  # type: ignore[attr-defined]
                group.append(i)
                sessions.add(sid)
            else:
                handled[i] = (self.run_other(req), None)
        flush()
        out: list[Resp] = []
        for req, span, h in zip(requests, spans, handled):
            assert h is not None
            resp, phases = h
            try:
                self._finish(req, resp, span, phases)
            except Exception:
                log.exception("recording a %s message failed", self.step_op)
            out.append(resp)
        return out

    def _error(self, req: Any, exc: BaseException) -> Any:
        resp = self._response(req)
        resp.error.CopyFrom(session_error(exc))
        return resp

    # ---- spans and metrics ------------------------------------------------------------

    def _start_span(self, req: Any) -> tr.Span | None:
        if not req.trace_context:
            return None
        op = req.WhichOneof("op") or "none"
        return self.tracing.start_remote_child(
            self.span_names.get(op, self.span_names[self.step_op]),
            req.trace_context,
            {
                tr.ATTR_SESSION_ID: tr.hashed_session_id(client_session_id(req.session_id)),
                tr.ATTR_COMMITTED_LENGTH: req.committed_length,
            },
        )

    def _finish(self, req: Any, resp: Any, span: tr.Span | None, phases: PhaseLog | None) -> None:
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
        if op == self.step_op and error is None:  # a successful step always carries its phases
            attributes = self.observe_step(req, resp, phases.batch_size if phases is not None else 1)
        if span is not None and phases is not None and span.is_recording():
            for p in phases.merged():
                child = self.tracing.start_span(
                    self.phase_span_prefix + p.name,
                    span,
                    start_time=p.start_ns,
                    attributes={tr.ATTR_PHASE_MS: round(phases.total_ms(p.name), 3)},
                )
                child.end(end_time=p.end_ns)
        tr.end_message_span(span, attributes, error)
        if self.metrics is not None:
            self.metrics.observe_message(op, "ok" if error is None else error[0])

    # ---- the stream ---------------------------------------------------------------------

    async def serve(self, request_iterator: AsyncIterator[Req], context: Any) -> AsyncIterator[Resp]:
        # Headers first, so the coordinator knows the stream is up before any round.
        await context.send_initial_metadata(())
        # Sessions belong to this stream (their own namespace), and close with it.
        scope = StreamSessions()
        async for response in serve_round_stream(
            request_iterator, self.batcher.submit, sessions=scope, make_request=self._empty_request
        ):
            yield response
