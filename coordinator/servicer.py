"""Translates the public Coordinator API into engine calls; nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from coordinator.calls import generate_chunks
from coordinator.engine import Chunk, RoundEngine
from specd.serving.tenancy import caller_identity
from specd.serving.wire import FINISH_REASONS, stats_to_proto
from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    def _chunks(
        self, method: str, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Chunk]:
        config = self.engine.config
        return generate_chunks(
            self.engine,
            method,
            request,
            remaining=context.time_remaining(),  # at arrival: the deadline counts the tokenizing too
            identity=caller_identity(context, token_checked=bool(config.api_token_file)),
            trace_carrier=context.invocation_metadata() if self.engine.tracing.enabled else (),
        )

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self._chunks("Generate", request, context):
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
        async for chunk in self._chunks("GenerateStream", request, context):
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
