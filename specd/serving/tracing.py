"""OpenTelemetry for specd: set-up, exporters, the Tracing a service hands around, context in messages.

Each service builds one `Tracing` at start (`setup_tracing`) and hands it to
what it creates; nothing here is global (no `trace.set_tracer_provider`, no
module-level mutable state). The names in a trace are in
specd.serving.trace_names; what specd puts on its spans (errors, request,
round and message attributes) in specd.serving.trace_spans.

Tracing is on when an OTLP endpoint is configured: the service's
--otlp-endpoint flag (SPECD_OTLP_ENDPOINT), else the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT. Otherwise
nothing is installed: the tracer is a no-op, no context is injected, and the
draft and target open no spans.

The shape of a trace (docs/observability.md has the full picture):

    text_completion MODEL       coordinator, one per Generate / GenerateStream (GenAI conventions)
      specd.round               coordinator, one per round, with its numbers
        specd.draft.open        draft: (re)build the session (prefill)
        specd.draft.propose     draft: roll back to the committed prefix, K forward passes + sampling
        specd.target.open       target: (re)build the session (prefill)
        specd.target.verify     target: forward pass over K+1, rejection sampling, roll-back

A stream between services opens once, so the round's W3C context rides in
each stream message (`trace_context`), injected and extracted here with the
propagator API. Exporting runs in a background thread behind a bounded
queue: a slow or unreachable collector drops spans, never requests.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import INVALID_SPAN, Link, NoOpTracer, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

import specd
from specd.core.errors import InvalidArgument
from specd.serving import genai
from specd.serving.trace_names import (
    ATTR_COMMITTED_LENGTH,
    ATTR_ROUND_INDEX,
    ATTR_RPC_METHOD,
    ATTR_RPC_SERVICE,
    ATTR_RPC_SYSTEM,
    INSTRUMENTATION_NAME,
    SERVICE_NAMES,
    SPAN_ROUND,
)

log = logging.getLogger(__name__)

_W3C = TraceContextTextMapPropagator()  # stateless


def _endpoint_from_env(env: Mapping[str, str]) -> str:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def _protocol(flag: str, env: Mapping[str, str]) -> str:
    """The flag, unless it is at its default (grpc) and the standard variables name another."""
    if flag and flag != "grpc":
        return flag
    return env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"


def _flag_endpoint(endpoint: str, protocol: str) -> str:
    """A flag endpoint as the exporter wants it.

    host:port (no scheme) means plaintext, like http://host:port. For OTLP/HTTP
    a base URL gets the traces path, as OTEL_EXPORTER_OTLP_ENDPOINT would.
    """
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if protocol == "http/protobuf" and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return endpoint


@dataclass(frozen=True)
class TracingSettings:
    """What tracing a service runs with, resolved from flags and OTEL_* variables."""

    service_name: str
    endpoint: str  # "" = tracing off; "env" style endpoints are left to the exporter
    protocol: str = "grpc"  # grpc | http/protobuf
    sample_ratio: float = 1.0
    from_flag: bool = True  # endpoint came from --otlp-endpoint (else from OTEL_* variables)
    public_edge: bool = False  # the coordinator: its remote parents are callers, not trusted services

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def resolve_settings(service: str, config: Any, env: Mapping[str, str] | None = None) -> TracingSettings:
    """Settings for `service` (coordinator | draft | target) from its config's otlp_* fields and env."""
    env = os.environ if env is None else env
    protocol = _protocol(config.otlp_protocol, env)
    if protocol not in ("grpc", "http/protobuf"):
        raise InvalidArgument(f"OTLP protocol must be grpc or http/protobuf (got {protocol!r})")
    if config.otlp_endpoint:
        endpoint, from_flag = _flag_endpoint(config.otlp_endpoint, protocol), True
    else:
        endpoint, from_flag = _endpoint_from_env(env), False
    return TracingSettings(
        SERVICE_NAMES.get(service, service),
        endpoint,
        protocol,
        config.trace_sample_ratio,
        from_flag,
        public_edge=service == "coordinator",
    )


class CallerRatio(Sampler):
    """Samples `ratio` of the spans whatever their trace ID: for a caller's sampled parent.

    TraceIdRatioBased decides by the trace ID's low 64 bits, which a caller
    chooses in its traceparent (all zeros would pass any ratio above 0);
    this draws its own number. A sampled span still joins the caller's trace.
    """

    def __init__(self, ratio: float) -> None:
        self._ratio = ratio
        self._random = random.Random()  # seeded from os.urandom; the caller never sees a draw

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if self._random.random() < self._ratio:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
        return SamplingResult(Decision.DROP, None, parent.trace_state)

    def get_description(self) -> str:
        return f"CallerRatio{{{self._ratio}}}"


def sampler(ratio: float, *, public_edge: bool) -> Sampler:
    """Which spans a service records: `ratio` of new traces, then every span under a sampled one.

    At the public edge (the coordinator's Generate span) a caller's traceparent
    is joined but its sampled flag forces nothing: the request is sampled at
    `ratio` like any other (so no caller can make every request traced), and
    never when the caller says not sampled. Draft and target follow their
    parent: the coordinator, which decided already.
    """
    root = TraceIdRatioBased(ratio)  # specd makes the trace ID of a new trace: random
    if public_edge:
        return ParentBased(root, remote_parent_sampled=CallerRatio(ratio), remote_parent_not_sampled=ALWAYS_OFF)
    return ParentBased(root)


@dataclass(frozen=True)
class Tracing:
    """A service's tracer, its provider (None when off) and the propagator for stream messages."""

    tracer: Tracer
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider when on
    propagator: TextMapPropagator = field(default=_W3C)
    settings: TracingSettings | None = None

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    # ---- context in messages ------------------------------------------------------

    def inject(self, span: Span) -> dict[str, str]:
        """The W3C context of `span` as a message map ({} when off or the span is invalid)."""
        if self.provider is None or not span.get_span_context().is_valid:
            return {}
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def extract(self, carrier: Mapping[str, str]) -> Context | None:
        """The context a message map carries, or None (off, empty, or not a valid context)."""
        if self.provider is None or not carrier:
            return None
        ctx = self.propagator.extract(carrier)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    # ---- spans ----------------------------------------------------------------------

    def start_span(
        self,
        name: str,
        parent: Span | Context | None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        start_time: int | None = None,
    ) -> Span:
        """A started span under `parent` (a span or a context); INVALID_SPAN when off.

        start_time: epoch ns, for a span recorded after the fact (phase spans).

        Never made current: specd passes spans explicitly (rounds of many
        requests interleave on one event loop and one model thread).
        """
        if self.provider is None:
            return INVALID_SPAN
        ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else (parent or Context())
        return self.tracer.start_span(name, context=ctx, kind=kind, attributes=attributes, start_time=start_time)

    def start_generate(self, method: str, metadata: Any = (), model: str = "") -> Span:
        """The span of one Generate call, continuing a W3C context the client sent in its metadata.

        Named and marked by the GenAI conventions: "text_completion MODEL", with
        gen_ai.operation.name, gen_ai.provider.name and gen_ai.request.model (the target's name).
        """
        if self.provider is None:
            return INVALID_SPAN
        carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        parent = self.extract(carrier) if "traceparent" in carrier else None
        attributes: dict[str, Any] = {
            ATTR_RPC_SYSTEM: "grpc",
            ATTR_RPC_SERVICE: "specd.v1.Coordinator",
            ATTR_RPC_METHOD: method,
            genai.ATTR_OPERATION: genai.OPERATION,
            genai.ATTR_PROVIDER: genai.PROVIDER,
        }
        if model:
            attributes[genai.ATTR_REQUEST_MODEL] = attributes[genai.ATTR_RESPONSE_MODEL] = model
        return self.tracer.start_span(
            genai.span_name(model), context=parent or Context(), kind=SpanKind.SERVER, attributes=attributes
        )

    def start_round(self, parent: Span | None, index: int, committed_length: int) -> Span:
        """A round span under the request's span; INVALID_SPAN when off or the request is not sampled.

        INVALID_SPAN injects nothing, so the draft and target then open no spans either.
        """
        if self.provider is None or parent is None or not parent.is_recording():
            return INVALID_SPAN
        return self.tracer.start_span(
            SPAN_ROUND,
            context=trace.set_span_in_context(parent),
            attributes={ATTR_ROUND_INDEX: index, ATTR_COMMITTED_LENGTH: committed_length},
        )

    def start_remote_child(self, name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any]) -> Span | None:
        """A SERVER span under the context a stream message carries; None when there is none.

        Messages without context (tracing off at the coordinator, session
        close) get no span: no orphan root spans.
        """
        ctx = self.extract(carrier)
        if ctx is None:
            return None
        return self.tracer.start_span(name, context=ctx, kind=SpanKind.SERVER, attributes=attributes)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued and stop, waiting at most timeout_s (a dead collector cannot stall exit)."""
        if self.provider is None:
            return
        done = threading.Thread(target=self.provider.shutdown, name="specd-tracing-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning("tracing: spans not flushed within %.1f s (collector unreachable?); dropping them", timeout_s)


TRACING_OFF = Tracing(NoOpTracer())  # immutable; what everything uses when no Tracing is given


def setup_tracing(service: str, config: Any, env: Mapping[str, str] | None = None) -> Tracing:
    """The Tracing for one service process: TRACING_OFF unless an OTLP endpoint is configured.

    config: a ServiceBase (otlp_endpoint, otlp_protocol, trace_sample_ratio).
    Other exporter settings (headers, timeout, compression, certificates,
    batch sizes) come from the standard OTEL_* variables, read by the SDK.
    """
    try:
        settings = resolve_settings(service, config, env)
    except InvalidArgument as exc:  # e.g. OTEL_EXPORTER_OTLP_PROTOCOL=http/json
        log.error("tracing off: %s", exc)
        return TRACING_OFF
    if not settings.enabled:
        return TRACING_OFF
    try:
        return _build(settings)
    except Exception as exc:  # noqa: BLE001 - tracing is auxiliary: a bad OTEL_* setting must not stop the service
        log.error("tracing off: could not set up OTLP export to %s: %s", settings.endpoint, exc)
        return TRACING_OFF


def _build(settings: TracingSettings) -> Tracing:
    if settings.protocol == "http/protobuf":
        exporter: Any = HttpExporter(endpoint=settings.endpoint if settings.from_flag else None)
    else:
        exporter = GrpcExporter(endpoint=settings.endpoint if settings.from_flag else None)
    resource = Resource.create(
        {
            "service.name": settings.service_name,
            "service.version": specd.__version__,
            "service.instance.id": uuid.uuid4().hex,
        }
    )
    provider = TracerProvider(
        sampler=sampler(settings.sample_ratio, public_edge=settings.public_edge),
        resource=resource,
        shutdown_on_exit=False,  # Tracing.shutdown bounds the flush; an atexit flush could hang on a dead collector
    )
    # Bounded queue (OTEL_BSP_MAX_QUEUE_SIZE, default 2048): when the collector is
    # slow or gone, spans are dropped; ending a span never waits for the network.
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing on: OTLP/%s to %s, sampling %.3g of requests",
        settings.protocol,
        settings.endpoint,
        settings.sample_ratio,
    )
    return Tracing(provider.get_tracer(INSTRUMENTATION_NAME, specd.__version__), provider, _W3C, settings)
