"""Tracing in-process: settings, context in messages, sampling, a dead collector (end to end: tests/services/test_tracing.py)."""

from __future__ import annotations

import secrets
import socket
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind

from specd.core.rounds.loop import GenerateSpec
from specd.core.sampling.sampler import SamplingParams
from specd.serving import trace_names, trace_spans
from specd.serving import tracing as tr
from specd.serving.config import CoordinatorConfig, DraftConfig


def test_tracing_is_off_without_an_endpoint() -> None:
    t = tr.setup_tracing("coordinator", CoordinatorConfig(), env={})
    assert t is tr.TRACING_OFF and not t.enabled and t.provider is None
    assert t.start_generate("Generate", [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is INVALID_SPAN
    assert t.start_round(INVALID_SPAN, 0, 5) is INVALID_SPAN
    assert t.inject(INVALID_SPAN) == {}
    assert (
        t.start_remote_child(
            trace_names.SPAN_DRAFT_PROPOSE, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, {}
        )
        is None
    )
    t.shutdown()  # nothing to do


def test_settings_follow_flags_then_standard_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    s = tr.resolve_settings("draft", DraftConfig(), env)
    assert (s.service_name, s.endpoint, s.protocol, s.from_flag) == (
        "specd-draft",
        "http://collector:4317",
        "grpc",
        False,
    )
    s = tr.resolve_settings("draft", DraftConfig(), {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317"})
    assert s.endpoint == "http://traces:4317"
    s = tr.resolve_settings("draft", DraftConfig(otlp_endpoint="jaeger:4317", trace_sample_ratio=0.25), env)
    assert (s.endpoint, s.from_flag, s.sample_ratio) == ("http://jaeger:4317", True, 0.25)  # no scheme: plaintext
    s = tr.resolve_settings(
        "target", DraftConfig(otlp_endpoint="http://jaeger:4318", otlp_protocol="http/protobuf"), {}
    )
    assert (s.service_name, s.endpoint, s.protocol) == ("specd-target", "http://jaeger:4318/v1/traces", "http/protobuf")
    s = tr.resolve_settings("coordinator", CoordinatorConfig(), {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert s.protocol == "http/protobuf" and s.service_name == "specd-coordinator"
    for protocol in ("grpc", "http/protobuf"):  # both exporters build (nothing is sent until spans end)
        t = tr.setup_tracing(
            "coordinator", CoordinatorConfig(otlp_endpoint="127.0.0.1:9", otlp_protocol=protocol), env={}
        )
        assert t.enabled
        resource = t.provider.resource.attributes
        assert resource["service.name"] == "specd-coordinator" and resource["service.version"]
        t.shutdown(timeout_s=2.0)


def _in_memory(ratio: float = 1.0, *, public_edge: bool = False) -> tuple[tr.Tracing, InMemorySpanExporter]:
    """A service's Tracing exporting to memory; public_edge: sampled as the coordinator is."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tr.sampler(ratio, public_edge=public_edge), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tr.Tracing(provider.get_tracer("test"), provider), exporter


def test_round_context_rides_in_messages() -> None:
    coordinator, exported = _in_memory(public_edge=True)
    draft, draft_exported = _in_memory()
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    generate = coordinator.start_generate("Generate", [("traceparent", f"00-{client_trace}-{client_span}-01")])
    rounds = [coordinator.start_round(generate, i, 10 + i) for i in range(2)]
    carriers = [coordinator.inject(r) for r in rounds]
    assert all(set(c) == {"traceparent"} for c in carriers)
    for carrier in carriers:
        child = draft.start_remote_child(trace_names.SPAN_DRAFT_PROPOSE, carrier, {trace_names.ATTR_SESSION_ID: "s"})
        trace_spans.end_message_span(child, {trace_names.ATTR_DRAFT_TOKENS: 4}, None)
    for r in rounds:
        r.end()
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        trace_spans.record_error(generate, exc)
    generate.end()
    spans = {s.context.span_id: s for s in exported.get_finished_spans()}
    gen = next(s for s in spans.values() if s.name == trace_names.SPAN_GENERATE)
    assert f"{gen.context.trace_id:032x}" == client_trace and f"{gen.parent.span_id:016x}" == client_span
    assert (
        gen.kind == SpanKind.SERVER
        and not gen.status.is_ok
        and gen.attributes[trace_names.ATTR_ERROR_TYPE] == "RuntimeError"
    )
    round_spans = [s for s in spans.values() if s.name == trace_names.SPAN_ROUND]
    assert [s.parent.span_id for s in round_spans] == [gen.context.span_id] * 2
    children = draft_exported.get_finished_spans()
    assert [c.parent.span_id for c in children] == [r.context.span_id for r in round_spans]
    assert all(c.context.trace_id == gen.context.trace_id and c.kind == SpanKind.SERVER for c in children)


def test_a_callers_sampled_flag_does_not_force_tracing_past_the_ratio() -> None:
    """At the coordinator a client's traceparent is joined, but whether to record is the ratio's call."""

    def traceparent(trace_id: str, flags: str = "01") -> list[tuple[str, str]]:
        return [("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-{flags}")]

    off, off_exported = _in_memory(ratio=0.0, public_edge=True)
    span = off.start_generate("Generate", traceparent(secrets.token_hex(16)))
    assert not span.is_recording() and off.start_round(span, 0, 3) is INVALID_SPAN
    span.end()
    assert off_exported.get_finished_spans() == ()

    on, on_exported = _in_memory(ratio=1.0, public_edge=True)
    client_trace = secrets.token_hex(16)
    span = on.start_generate("Generate", traceparent(client_trace))
    assert span.is_recording()
    span.end()
    (got,) = on_exported.get_finished_spans()
    assert f"{got.context.trace_id:032x}" == client_trace  # joins the caller's trace
    unsampled = on.start_generate("Generate", traceparent(secrets.token_hex(16), flags="00"))
    assert not unsampled.is_recording()  # a caller may opt out of tracing, never in

    # The trace ID is the caller's to choose: one whose low 64 bits are 0 passes any trace-ID ratio test.
    tenth, _ = _in_memory(ratio=0.1, public_edge=True)
    spans = [tenth.start_generate("Generate", traceparent(secrets.token_hex(8) + "0" * 16)) for _ in range(400)]
    recorded = sum(s.is_recording() for s in spans)
    for s in spans:
        s.end()
    assert 10 <= recorded <= 80, recorded  # about 40 of 400 (binomial: 0.1 of 400, sd 6)

    # Draft and target follow their parent, the coordinator, whatever their own ratio.
    draft, _ = _in_memory(ratio=0.0)
    child = draft.start_remote_child(trace_names.SPAN_DRAFT_PROPOSE, dict(traceparent(secrets.token_hex(16))), {})
    assert child is not None and child.is_recording()
    # setup_tracing samples the coordinator at the edge, draft and target by their parent.
    assert tr.resolve_settings("coordinator", CoordinatorConfig(), {}).public_edge
    assert not tr.resolve_settings("draft", DraftConfig(), {}).public_edge


def test_spans_record_how_many_stop_strings_never_the_strings() -> None:
    """A stop string may be a secret or the user's text: the Generate span keeps its count only."""
    secret = "sk-" + secrets.token_hex(8)
    coordinator, exported = _in_memory(public_edge=True)
    spec = GenerateSpec([1, 2, 3], SamplingParams(seed=7), max_new_tokens=4, stop_strings=(secret, "\n\n"))
    generate = coordinator.start_generate("Generate", ())
    generate.set_attributes(trace_spans.request_attributes(spec))
    coordinator.start_round(generate, 0, 3).end()
    generate.end()
    spans = exported.get_finished_spans()
    assert len(spans) == 2
    (gen,) = [s for s in spans if s.name == trace_names.SPAN_GENERATE]
    assert gen.attributes[trace_names.ATTR_STOP_STRINGS] == 2
    assert "gen_ai.request.stop_sequences" not in gen.attributes
    assert not [v for s in spans for v in s.attributes.values() if secret in str(v)]


def test_unsampled_requests_send_no_context() -> None:
    coordinator, exported = _in_memory(ratio=0.0, public_edge=True)
    generate = coordinator.start_generate("Generate", ())
    assert not generate.is_recording()
    round_span = coordinator.start_round(generate, 0, 3)
    assert round_span is INVALID_SPAN and coordinator.inject(round_span) == {}
    generate.end()
    assert exported.get_finished_spans() == ()


def test_dead_collector_neither_blocks_spans_nor_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that accepts connections and never answers: ending spans stays cheap, exit is bounded."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "32")
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)  # never accepted: the exporter's calls hang until their timeout
        port = blackhole.getsockname()[1]
        t = tr.setup_tracing("target", DraftConfig(otlp_endpoint=f"127.0.0.1:{port}"), env={})
        parent = t.start_generate("Generate", ())
        start = time.perf_counter()
        for i in range(3000):
            t.start_round(parent, i, i).end()
        per_span_us = (time.perf_counter() - start) / 3000 * 1e6
        parent.end()
        start = time.perf_counter()
        t.shutdown(timeout_s=1.0)
        assert time.perf_counter() - start < 3.0
    assert per_span_us < 500, per_span_us
