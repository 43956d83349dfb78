"""A real OTLP/gRPC trace receiver: the collector's TraceService, keeping what it gets.

Used by the tests (spans to assert on) and by `specd bench --tracing` (a
local sink, so tracing overhead is measured with real export, no Jaeger).

    with OtlpReceiver() as receiver:      # listens on 127.0.0.1:<free port>
        ... --otlp-endpoint receiver.endpoint ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 10)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # resource service.name
    resource: dict[str, Any]
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    events: tuple[str, ...]
    start_ns: int = 0  # epoch nanoseconds
    end_ns: int = 0


def _value(v: common_pb2.AnyValue) -> Any:
    """An attribute value as Python: arrays as lists (e.g. gen_ai.response.finish_reasons), maps as dicts."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, host: str = "127.0.0.1", *, keep: bool = True) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.keep = keep  # False: count spans only (a long bench would otherwise hold them all)
        self.exports = 0
        self.span_count = 0
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-receiver"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.host = host
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes=_attributes(s.attributes),
                            status_code=s.status.code,
                            events=tuple(e.name for e in s.events),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self._lock:
            if self.keep:
                self._spans.extend(got)
            self.span_count += len(got)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans once done(spans) holds; the spans so far when timeout passes (the caller asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
