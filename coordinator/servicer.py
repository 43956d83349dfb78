"""Translates the public Coordinator API into engine calls; nothing else."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

import grpc

from coordinator.engine import Chunk, RoundEngine
from coordinator.requests import check_sizes, prompt_ids, spec_from_prompt
from specd.serving import trace_spans
from specd.serving import tracing as tr
from specd.serving.grpc_errors import status_code
from specd.serving.tenancy import caller_identity
from specd.serving.wire import FINISH_REASONS, stats_to_proto
from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    async def _chunks(
        self,
        request: coordinator_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        span: tr.Span = tr.INVALID_SPAN,
    ) -> AsyncGenerator[Chunk, None]:
        arrival = time.monotonic()
        remaining = context.time_remaining()  # at arrival: the deadline counts the tokenizing too
        engine = self.engine
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
            identity=caller_identity(context, token_checked=bool(config.api_token_file)),
        )
        budget = config.request_timeout_s if remaining is None else min(remaining, config.request_timeout_s)
        if span.is_recording():
            span.set_attributes(trace_spans.request_attributes(spec))
        async with aclosing(engine.generate(spec, deadline=arrival + budget, arrival=arrival, span=span)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _observed(
        self, method: str, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Chunk]:
        """The request's chunks inside its Generate span; request metrics when it ends."""
        engine = self.engine
        arrival = time.monotonic()
        model = engine.target_info.name if engine.target_info is not None else ""
        metadata = context.invocation_metadata() if engine.tracing.enabled else ()
        span = engine.tracing.start_generate(method, metadata, model)
        try:
            async with aclosing(self._chunks(request, context, span)) as chunks:
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

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self._observed("Generate", request, context):
            response.token_ids.extend(chunk.token_ids)
            response.text += chunk.text
            if chunk.finish_reason is not None:
                response.finish_reason = FINISH_REASONS[chunk.finish_reason]
            if chunk.stats is not None:
                response.stats.CopyFrom(stats_to_proto(chunk.stats))
        return response

    async def GenerateStream(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        async for chunk in self._observed("GenerateStream", request, context):
            msg = coordinator_pb2.GenerateStreamResponse(token_ids=chunk.token_ids, text=chunk.text)
            if chunk.finish_reason is not None:
                msg.finish_reason = FINISH_REASONS[chunk.finish_reason]
            if chunk.stats is not None:
                msg.stats.CopyFrom(stats_to_proto(chunk.stats))
            yield msg

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        assert self.engine.target_info is not None
        return self.engine.target_info
