"""OpenTelemetry for specd: set-up, span names, attribute names, context in messages.

One place for all of it. Each service builds one `Tracing` at start
(`setup_tracing`) and hands it to what it creates; nothing here is global
(no `trace.set_tracer_provider`, no module-level mutable state).

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

import asyncio
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Mapping
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
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import specd
from specd.core.errors import InvalidArgument
from specd.core.record import RoundRecord
from specd.serving import genai

log = logging.getLogger(__name__)

# ---- service names (resource service.name) ------------------------------------

SERVICE_COORDINATOR = "specd-coordinator"
SERVICE_DRAFT = "specd-draft"
SERVICE_TARGET = "specd-target"
SERVICE_NAMES = {"coordinator": SERVICE_COORDINATOR, "draft": SERVICE_DRAFT, "target": SERVICE_TARGET}
INSTRUMENTATION_NAME = "specd"

# ---- span names ------------------------------------------------------------------

# The Generate span follows the GenAI conventions: "text_completion MODEL" (genai.span_name).
SPAN_GENERATE = genai.OPERATION  # its name without the model, and its gen_ai.operation.name
SPAN_ROUND = "specd.round"
SPAN_DRAFT_OPEN = "specd.draft.open"
SPAN_DRAFT_PROPOSE = "specd.draft.propose"
SPAN_DRAFT_CLOSE = "specd.draft.close"
SPAN_TARGET_OPEN = "specd.target.open"
SPAN_TARGET_VERIFY = "specd.target.verify"
SPAN_TARGET_CLOSE = "specd.target.close"
# Phase spans, children of a propose / verify span (see specd.core.phases): PREFIX + phase name,
# e.g. specd.target.forward, specd.draft.sampling, specd.target.rollback.
SPAN_DRAFT_PHASE_PREFIX = "specd.draft."
SPAN_TARGET_PHASE_PREFIX = "specd.target."

# ---- attribute names (vLLM's words: drafts, draft tokens, accepted, recovered, bonus) ----

# generic RPC attributes (OpenTelemetry semantic conventions)
ATTR_RPC_SYSTEM = "rpc.system"
ATTR_RPC_SERVICE = "rpc.service"
ATTR_RPC_METHOD = "rpc.method"

ATTR_SESSION_ID = "specd.session_id"  # hashed (hashed_session_id): a span reader cannot name a live session
ATTR_COMMITTED_LENGTH = "specd.committed_length"  # tokens committed before this round / message
ATTR_ERROR_TYPE = "error.type"  # semconv: the exception class that failed the operation
ATTR_CANCELLED = "specd.cancelled"

# Generate span: request settings. Where the GenAI conventions name a setting, that name
# (gen_ai.request.*); specd's own settings keep specd.request.*.
ATTR_GENAI_OPERATION = genai.ATTR_OPERATION
ATTR_MODEL = genai.ATTR_REQUEST_MODEL
ATTR_PROMPT_TOKENS = genai.ATTR_USAGE_INPUT_TOKENS
ATTR_MAX_NEW_TOKENS = genai.ATTR_REQUEST_MAX_TOKENS
ATTR_TEMPERATURE = genai.ATTR_REQUEST_TEMPERATURE
ATTR_TOP_K = genai.ATTR_REQUEST_TOP_K
ATTR_TOP_P = genai.ATTR_REQUEST_TOP_P
ATTR_SEED = genai.ATTR_REQUEST_SEED
ATTR_STOP_SEQUENCES = genai.ATTR_REQUEST_STOP_SEQUENCES  # the stop strings themselves (only when given)
ATTR_MIN_P = "specd.request.min_p"
ATTR_SPECULATION = "specd.request.speculation"  # auto | fixed | off
ATTR_REQUEST_DRAFT_LENGTH = "specd.request.draft_length"  # K the request runs with
ATTR_STOP_STRINGS = "specd.request.stop_strings"  # how many
# Generate span: the response (GenAI) and the final stats (the response's GenerateStats)
ATTR_RESPONSE_ID = genai.ATTR_RESPONSE_ID  # = specd.session_id
ATTR_RESPONSE_MODEL = genai.ATTR_RESPONSE_MODEL
ATTR_FINISH_REASONS = genai.ATTR_RESPONSE_FINISH_REASONS  # ["stop"] or ["length"]
ATTR_COMPLETION_TOKENS = genai.ATTR_USAGE_OUTPUT_TOKENS
ATTR_FINISH_REASON = "specd.finish_reason"  # the exact reason: length, stop_token, stop_string, context_full
ATTR_ROUNDS = "specd.rounds"
ATTR_DRAFTS = "specd.drafts"  # rounds that verified >= 1 draft token
ATTR_DRAFT_TOKENS = "specd.draft_tokens"
ATTR_ACCEPTED_TOKENS = "specd.accepted_tokens"
ATTR_ACCEPTANCE_LENGTH = "specd.acceptance_length"  # 1 + accepted / drafts
ATTR_ACCEPTANCE_RATE = "specd.acceptance_rate"  # accepted / draft tokens
ATTR_TARGET_ONLY_ROUNDS = "specd.target_only_rounds"
ATTR_PIPELINE_HITS = "specd.pipeline_hits"  # rounds whose drafts were made during the previous verify
ATTR_TTFT_MS = "specd.time_to_first_token_ms"
ATTR_TOKENS_PER_S = "specd.tokens_per_s"
ATTR_DRAFT_MS = "specd.draft_ms"  # draft model compute (reported by the draft)
ATTR_VERIFY_MS = "specd.verify_ms"  # target model compute (reported by the target)
ATTR_OVERHEAD_MS = "specd.overhead_ms"  # wall time minus both: network, queues, coordinator

# Round span
ATTR_ROUND_INDEX = "specd.round.index"  # 0-based within the request
ATTR_ROUND_DRAFT_LENGTH = "specd.round.draft_length"  # K asked of the draft (0: target-only round)
ATTR_ROUND_DRAFT_TOKENS = "specd.round.draft_tokens"  # draft tokens verified
ATTR_ROUND_ACCEPTED = "specd.round.accepted"  # draft tokens accepted
ATTR_ROUND_TOKEN_KIND = "specd.round.token_kind"  # the extra token: "recovered", "bonus" or "deferred"
ATTR_ROUND_TOKENS = "specd.round.tokens"  # tokens committed (accepted + 1, cut at a stop)
ATTR_ROUND_TARGET_ONLY = "specd.round.target_only"  # wanted draft tokens, got none (draft down or failing)
ATTR_ROUND_PIPELINE_HIT = "specd.round.pipeline_hit"  # the round's draft came from pipelining
ATTR_ROUND_TARGET_ONLY_REASON = "specd.round.target_only_reason"  # why no draft tokens were verified ("" if some were)
ATTR_ROUND_PIPELINE_OUTCOME = "specd.round.pipeline_outcome"  # the hit's outcome "accepted:kind" ("" if no hit)
ATTR_ROUND_PIPELINE_LAUNCHED = "specd.round.pipeline_launched"  # pre-drafts launched for the next round
ATTR_ROUND_DRAFT_MS = "specd.round.draft_ms"
ATTR_ROUND_VERIFY_MS = "specd.round.verify_ms"
ATTR_ROUND_OVERHEAD_MS = "specd.round.overhead_ms"
ATTR_ROUND_WALL_MS = "specd.round.wall_ms"
ATTR_TARGET_REPLICA = "specd.target.replica"  # the target replica (address) holding the session
ATTR_DRAFT_REPLICA = "specd.draft.replica"  # the draft replica holding the session (absent: none yet)

# Draft and target spans
ATTR_NUM_TOKENS = "specd.draft.num_tokens"  # K asked (propose)
ATTR_COMPUTE_MS = "specd.compute_ms"  # model time of this message
ATTR_ACCEPTED = "specd.accepted"  # target verify: draft tokens accepted
ATTR_TOKEN_KIND = "specd.token_kind"  # target verify: "recovered" or "bonus"
ATTR_SESSION_ERROR = "specd.session_error"  # in-band error code sent back to the coordinator
ATTR_BATCH_SIZE = "specd.batch_size"  # sessions that shared this step's forward pass
ATTR_PHASE_MS = "specd.phase_ms"  # phase span: time spent in the phase (a draft's K steps summed)

TOKEN_KIND_BONUS = "bonus"
TOKEN_KIND_RECOVERED = "recovered"
TOKEN_KIND_DEFERRED = "deferred"  # post-verify pipelining: all accepted, the bonus left to the next round

_W3C = TraceContextTextMapPropagator()  # stateless


def hashed_session_id(session_id: str) -> str:
    """What spans record for a session: 32 hex digits of its SHA-256 (shaped like the ID). The same on every
    service, so the coordinator's and the peers' spans of one session still match."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:32]


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
        SERVICE_NAMES.get(service, service), endpoint, protocol, config.trace_sample_ratio, from_flag
    )


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
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
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


# ---- errors and attribute sets ----------------------------------------------------------


def error_name(exc: BaseException) -> str:
    """A short, bounded name for what ended an operation ("cancelled" for a cancellation)."""
    return "cancelled" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else type(exc).__name__


def record_error(span: Span, exc: BaseException) -> None:
    """Mark `span` failed by `exc` (a cancellation is marked as such, without a stack)."""
    if not span.is_recording():
        return
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_attribute(ATTR_CANCELLED, True)
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    span.set_attribute(ATTR_ERROR_TYPE, type(exc).__name__)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def end_message_span(span: Span | None, attributes: Mapping[str, Any] | None, error: tuple[str, str] | None) -> None:
    """End a draft/target message span: its result attributes, or the in-band error (code, message)."""
    if span is None:
        return
    if span.is_recording():
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_attribute(ATTR_SESSION_ERROR, error[0])
            span.set_status(Status(StatusCode.ERROR, f"{error[0]}: {error[1]}"))
    span.end()


def token_kind(is_bonus: bool, deferred: bool = False) -> str:
    if deferred:
        return TOKEN_KIND_DEFERRED
    return TOKEN_KIND_BONUS if is_bonus else TOKEN_KIND_RECOVERED


def request_attributes(spec: Any) -> dict[str, Any]:
    """Generate-span attributes of a validated request (specd.core.loop.GenerateSpec)."""
    p = spec.params
    attributes: dict[str, Any] = {
        ATTR_PROMPT_TOKENS: len(spec.prompt_ids),
        ATTR_MAX_NEW_TOKENS: spec.max_new_tokens,
        ATTR_TEMPERATURE: float(p.temperature),
        ATTR_TOP_K: float(p.top_k),  # a double in the conventions; 0 = off
        ATTR_TOP_P: float(p.top_p),
        ATTR_MIN_P: float(p.min_p),
        ATTR_SEED: int(p.seed),
        ATTR_SPECULATION: spec.speculation,
        ATTR_REQUEST_DRAFT_LENGTH: 0 if spec.speculation == "off" else int(spec.draft_length),
        ATTR_STOP_STRINGS: len(spec.stop_strings),
    }
    if spec.stop_strings:
        attributes[ATTR_STOP_SEQUENCES] = list(spec.stop_strings)
    return attributes


def stats_attributes(stats: Any, finish_reason: str) -> dict[str, Any]:
    """Generate-span attributes of a finished request (specd.core.record.RequestStats)."""
    r = stats.rounds
    return {
        ATTR_FINISH_REASON: finish_reason,
        ATTR_FINISH_REASONS: genai.finish_reasons(finish_reason),
        ATTR_ROUNDS: r.rounds,
        ATTR_DRAFTS: r.drafts,
        ATTR_DRAFT_TOKENS: r.draft_tokens,
        ATTR_ACCEPTED_TOKENS: r.accepted_tokens,
        ATTR_ACCEPTANCE_LENGTH: float(r.acceptance_length),
        ATTR_ACCEPTANCE_RATE: float(r.acceptance_rate),
        ATTR_TARGET_ONLY_ROUNDS: r.target_only_rounds,
        ATTR_PIPELINE_HITS: r.pipeline_hits,
        ATTR_COMPLETION_TOKENS: stats.completion_tokens,
        ATTR_TTFT_MS: float(stats.time_to_first_token_ms),
        ATTR_TOKENS_PER_S: float(stats.tokens_per_s),
        ATTR_DRAFT_MS: float(stats.draft_ms),
        ATTR_VERIFY_MS: float(stats.verify_ms),
        ATTR_OVERHEAD_MS: float(stats.overhead_ms),
    }


def finish_generate(span: Span, stats: Any, finish_reason: str) -> None:
    """Set a finished request's attributes on its Generate span.

    gen_ai.response.id is the request's session ID, which the engine set on
    the span as specd.session_id when the request started.
    """
    if not span.is_recording():
        return
    attributes = stats_attributes(stats, finish_reason)
    session_id = (getattr(span, "attributes", None) or {}).get(ATTR_SESSION_ID)  # an SDK span's attributes
    if session_id:
        attributes[ATTR_RESPONSE_ID] = session_id
    span.set_attributes(attributes)


def round_attributes(record: RoundRecord) -> dict[str, Any]:
    """Round-span attributes, set once when the round has committed (all from its record)."""
    hit = record.pipeline_hit
    return {
        ATTR_ROUND_DRAFT_LENGTH: record.draft_length,
        ATTR_ROUND_DRAFT_TOKENS: record.draft_tokens,
        ATTR_ROUND_ACCEPTED: record.accepted,
        ATTR_ROUND_TOKEN_KIND: record.token_kind.value,
        ATTR_ROUND_TOKENS: record.tokens,
        ATTR_ROUND_TARGET_ONLY: record.fallback,
        ATTR_ROUND_TARGET_ONLY_REASON: record.target_only.value if record.target_only is not None else "",
        ATTR_ROUND_PIPELINE_HIT: hit is not None,
        ATTR_ROUND_PIPELINE_OUTCOME: hit.outcome if hit is not None else "",
        ATTR_ROUND_PIPELINE_LAUNCHED: record.pipeline_launched,
        ATTR_ROUND_DRAFT_MS: float(record.draft_ms),
        ATTR_ROUND_VERIFY_MS: float(record.verify_ms),
        ATTR_ROUND_OVERHEAD_MS: float(record.overhead_ms),
        ATTR_ROUND_WALL_MS: float(record.wall_ms),
    }
