"""Translates Draft stream messages into drafter calls; nothing else."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from specd.drafting import Drafter
from specd.errors import InvalidArgument
from specd.grpc_errors import session_error
from specd.streams import serve_round_stream
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specd.wire import params_from_proto, proposal_to_proto

log = logging.getLogger(__name__)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter, executor: Executor, info: common_pb2.ModelInfo, max_draft_tokens: int) -> None:
        self.drafter = drafter
        self.executor = executor
        self.info = info
        self.max_draft_tokens = max_draft_tokens

    def handle(self, req: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        """One request, on the model thread; per-session errors go back in-band."""
        resp = draft_pb2.DraftResponse(
            request_id=req.request_id, session_id=req.session_id, committed_length=req.committed_length
        )
        try:
            op = req.WhichOneof("op")
            if op == "propose":
                p = req.propose
                if not 1 <= p.num_tokens <= self.max_draft_tokens:
                    raise InvalidArgument(f"num_tokens must be in 1..{self.max_draft_tokens} (got {p.num_tokens})")
                proposal = self.drafter.propose(
                    req.session_id, req.committed_length, p.start, list(p.token_ids), p.num_tokens
                )
                resp.proposal.CopyFrom(proposal_to_proto(proposal))
            elif op == "open":
                if len(req.open.token_ids) != req.committed_length:
                    raise InvalidArgument("open: committed_length must equal the number of token_ids")
                self.drafter.open(
                    req.session_id, list(req.open.token_ids), params_from_proto(req.open.sampling), req.open.wire_top_k
                )
                resp.ack.SetInParent()
            elif op == "close":
                self.drafter.close(req.session_id)
                resp.ack.SetInParent()
            else:
                raise InvalidArgument("DraftRequest needs one of open, propose, close")
        except Exception as exc:  # noqa: BLE001 - reported in-band; internals logged by session_error
            resp.error.CopyFrom(session_error(exc))
        return resp

    async def Rounds(
        self, request_iterator: AsyncIterator[draft_pb2.DraftRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResponse]:
        # Headers first, so the coordinator knows the stream is up before any round.
        await context.send_initial_metadata(())
        async for response in serve_round_stream(request_iterator, self.handle, self.executor):
            yield response

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.info
