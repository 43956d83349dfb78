"""The coordinator's peers: GrpcTarget checks a verdict against the vocabulary its replica reported (a
token outside it is the target out of step: Unavailable, retried, never blamed on the draft's relayed
q), and a PeerStream sends the requests of one event-loop turn as one stream message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.peers import Answer, GrpcTarget, PeerStream, open_channel
from specd.core.errors import Unavailable
from specd.core.rounds.steps import VerifyOutcome, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.serving import wire
from specd.v1 import common_pb2, draft_pb2, target_pb2

V = 50


class _Stub:
    async def GetModelInfo(self, request: Any, timeout: float) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(vocab_size=V)


def _verify(token_id: int, *, relayed: bool) -> VerifyOutcome:
    async def go() -> VerifyOutcome:
        peer = GrpcTarget(open_channel("127.0.0.1:1"))  # never connects: the stream call is replaced
        peer._stub = _Stub()
        await peer.model_info(timeout=1.0)
        resp = target_pb2.TargetResponse(committed_length=3)
        resp.verdict.accepted, resp.verdict.token_id, resp.verdict.compute_ms = 0, token_id, 2.0

        async def call(req: Any, timeout: float) -> Answer[target_pb2.TargetResponse]:
            return Answer(resp, 4.0, 0.1)

        peer.call = call  # type: ignore[method-assign]
        rows = [common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in (1, 2)]
        draft = draft_pb2.DraftProposal(token_ids=[1, 2], q=rows)
        proposal = wire.proposal_from_proto(draft, V, relay=True) if relayed else Proposal([1, 2])
        assert (proposal.wire_q is not None) == relayed  # a relayed q: a refusal would be blamed on the draft
        return await peer.verify(VerifyRequest("s", 3, proposal), timeout=1.0, carrier={})

    return asyncio.run(go())


@pytest.mark.parametrize("relayed", [True, False])
def test_a_verdict_token_outside_the_reported_vocabulary_is_unavailable(relayed: bool) -> None:
    assert _verify(V - 1, relayed=relayed).token_id == V - 1
    with pytest.raises(Unavailable, match="outside the vocabulary"):
        _verify(V, relayed=relayed)


class _EchoCall:
    """A round stream's call as grpc.aio gives it: reads the outgoing messages, answers each in one message."""

    def __init__(self, outgoing: Any) -> None:
        self.outgoing = outgoing
        self.sent: list[list[int]] = []  # the request ids of each stream message the coordinator sent

    async def wait_for_connection(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    async def __aiter__(self) -> Any:
        async for message in self.outgoing:
            self.sent.append([r.request_id for r in message.requests])
            answers = [
                target_pb2.TargetResponse(request_id=r.request_id, session_id=r.session_id) for r in message.requests
            ]
            yield target_pb2.TargetResponses(responses=answers)


def test_the_requests_of_one_loop_turn_travel_as_one_stream_message() -> None:
    calls: list[_EchoCall] = []

    def open_call(outgoing: Any) -> _EchoCall:
        calls.append(_EchoCall(outgoing))
        return calls[-1]

    async def go() -> None:
        stream: PeerStream[Any, Any] = PeerStream(
            "target",
            open_call,
            pack=lambda requests: target_pb2.TargetRequests(requests=requests),
            unpack=lambda message: message.responses,
        )
        assert await stream.wait_connected(1.0)

        async def one(sid: str) -> str:
            answer = await stream.request(target_pb2.TargetRequest(session_id=sid), timeout=5.0)
            return answer.response.session_id

        together = await asyncio.gather(*(one(f"s{i}") for i in range(5)))  # one turn: five requests
        alone = [await one("a"), await one("b")]  # one after the other: a message each
        assert together == [f"s{i}" for i in range(5)] and alone == ["a", "b"]
        assert [len(ids) for ids in calls[0].sent] == [5, 1, 1]
        await stream.close()

    asyncio.run(go())
