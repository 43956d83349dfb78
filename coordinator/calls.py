"""One Generate call, whatever port it came in on (gRPC, the OpenAI HTTP API).

The steps and their order are the public edge's (coordinator.requests): the
size caps, admission, the prompt tokenized off the event loop, the validated
spec, then the engine's rounds. Around them: the request's Generate span and
its metrics when it ends (a cancellation, the caller gone, counts as a
CANCELLED failure). The ports only translate their messages to a
GenerateRequest and the Chunks back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from contextlib import aclosing
from typing import Any

from coordinator.engine import Chunk, RoundEngine
from coordinator.requests import check_sizes, prompt_ids, spec_from_prompt
from specd.serving import trace_spans
from specd.serving import tracing as tr
from specd.serving.grpc_errors import status_code
from specd.v1 import coordinator_pb2


async def _chunks(
    engine: RoundEngine,
    request: coordinator_pb2.GenerateRequest,
    *,
    remaining: float | None,
    identity: str,
    span: tr.Span = tr.INVALID_SPAN,
) -> AsyncGenerator[Chunk, None]:
    arrival = time.monotonic()
    config = engine.config
    check_sizes(request, config, engine.max_context)
    engine.admit()  # after the size caps, before tokenizing
    ids = await engine.off_loop(lambda: prompt_ids(request, engine.tokenizer, config, engine.vocab_size))
    spec = spec_from_prompt(
        request,
        ids,
        config,
        vocab_size=engine.vocab_size,
        max_context=engine.max_context,
        eos_token_ids=engine.eos_token_ids,
        identity=identity,
    )
    budget = config.request_timeout_s if remaining is None else min(remaining, config.request_timeout_s)
    if span.is_recording():
        span.set_attributes(trace_spans.request_attributes(spec))
    async with aclosing(engine.generate(spec, deadline=arrival + budget, arrival=arrival, span=span)) as chunks:
        async for chunk in chunks:
            yield chunk


async def generate_chunks(
    engine: RoundEngine,
    method: str,
    request: coordinator_pb2.GenerateRequest,
    *,
    remaining: float | None,
    identity: str,
    trace_carrier: Iterable[tuple[str, Any]] = (),
    span_attributes: Mapping[str, Any] | None = None,
) -> AsyncGenerator[Chunk, None]:
    """The request's chunks inside its Generate span; request metrics when it ends.

    remaining: seconds the caller's deadline leaves, taken at arrival (None: --request-timeout-s).
    identity: the caller's, as its port proved it (specd.serving.tenancy).
    trace_carrier: (key, value) pairs that may hold a W3C traceparent (gRPC metadata, HTTP headers).
    """
    arrival = time.monotonic()
    model = engine.target_info.name if engine.target_info is not None else ""
    span = engine.tracing.start_generate(method, trace_carrier if engine.tracing.enabled else (), model)
    if span_attributes and span.is_recording():
        span.set_attributes(dict(span_attributes))
    try:
        async with aclosing(_chunks(engine, request, remaining=remaining, identity=identity, span=span)) as chunks:
            async for chunk in chunks:
                if chunk.stats is not None and chunk.finish_reason is not None:
                    trace_spans.finish_generate(span, chunk.stats, chunk.finish_reason.value)
                    if engine.metrics is not None:
                        engine.metrics.observe_request(
                            chunk.stats, chunk.finish_reason.value, time.monotonic() - arrival, model=model
                        )
                yield chunk
    except BaseException as exc:
        trace_spans.record_error(span, exc)
        if engine.metrics is not None:
            engine.metrics.observe_failure(
                trace_spans.error_name(exc), status_code(exc).name, time.monotonic() - arrival, model=model
            )
        raise
    finally:
        span.end()
