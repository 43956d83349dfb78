"""The server side of a round stream (specd.serving.streams), without gRPC: answers, batching, and the drain on shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from specd.serving.batching import Deliver
from specd.serving.streams import Stamped, StreamScope, serve_round_stream
from specd.v1 import draft_pb2


def _request(session: str, op: str) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(session_id=session)
    getattr(req, op).SetInParent()
    return req


Item = Stamped[draft_pb2.DraftRequest]


def _answer(items: list[Item], deliver: Deliver[Item, draft_pb2.DraftResponse]) -> None:
    """The batcher's part, at once: every request answered, one delivery per stream message."""
    deliver([(s, draft_pb2.DraftResponse(session_id=s.request.session_id)) for s in items])


def _stream(messages: AsyncIterator[draft_pb2.DraftRequests], **kwargs: Any) -> AsyncIterator[Any]:
    return serve_round_stream(
        messages,
        _answer,
        unpack=lambda m: m.requests,
        pack=lambda responses: draft_pb2.DraftResponses(responses=responses),
        **kwargs,
    )


class Feed:
    """A request stream the test writes to, as a coordinator would; it never ends by itself."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[draft_pb2.DraftRequests] = asyncio.Queue()

    def put(self, *requests: draft_pb2.DraftRequest) -> None:
        self.queue.put_nowait(draft_pb2.DraftRequests(requests=requests))

    async def __aiter__(self) -> AsyncIterator[draft_pb2.DraftRequests]:
        while True:
            yield await self.queue.get()


async def _collect(
    stream: AsyncIterator[draft_pb2.DraftResponses], into: list[str], sizes: list[int] | None = None
) -> None:
    async for message in stream:
        into.extend(resp.session_id for resp in message.responses)
        if sizes is not None:
            sizes.append(len(message.responses))


def test_a_draining_stream_serves_its_open_sessions_and_ends_when_the_last_one_closes() -> None:
    async def main() -> None:
        feed, drain, got = Feed(), asyncio.Event(), []
        scope = StreamScope()
        stream = _stream(feed.__aiter__(), scope=scope, make_request=draft_pb2.DraftRequest, drain=drain)
        task = asyncio.ensure_future(_collect(stream, got))
        for op in ("open", "propose"):
            feed.put(_request("a", op))
        await asyncio.sleep(0.05)
        drain.set()  # shutting down with session a open: it goes on
        feed.put(_request("a", "propose"))
        await asyncio.sleep(0.05)
        assert not task.done() and got == ["a", "a", "a"]
        feed.put(_request("a", "close"))  # the request is done: the stream ends after answering it
        await asyncio.wait_for(task, 5)
        assert got == ["a"] * 4 and not scope.open

    asyncio.run(main())


def test_an_idle_stream_ends_as_soon_as_the_service_drains() -> None:
    async def main() -> None:
        feed, drain, got = Feed(), asyncio.Event(), []
        stream = _stream(feed.__aiter__(), scope=StreamScope(), make_request=draft_pb2.DraftRequest, drain=drain)
        task = asyncio.ensure_future(_collect(stream, got))
        for op in ("open", "close"):
            feed.put(_request("b", op))
        await asyncio.sleep(0.05)
        assert not task.done()  # no drain yet: an idle stream stays up
        drain.set()
        await asyncio.wait_for(task, 5)
        assert got == ["b", "b"]

    asyncio.run(main())


def test_without_a_drain_a_stream_answers_every_request_and_ends_with_its_requests() -> None:
    async def requests() -> AsyncIterator[draft_pb2.DraftRequests]:
        for i in range(0, 300, 3):  # more than max_pending: the stream reads on as it answers
            yield draft_pb2.DraftRequests(requests=[_request(f"s{j}", "propose") for j in range(i, i + 3)])

    async def main() -> tuple[list[str], list[int]]:
        got: list[str] = []
        sizes: list[int] = []
        await asyncio.wait_for(_collect(_stream(requests(), max_pending=8), got, sizes), 10)
        return got, sizes

    got, sizes = asyncio.run(main())
    assert got == [f"s{i}" for i in range(300)]
    assert sizes == [3] * 100  # one answer message per delivery, holding that message's answers


def test_one_delivery_of_many_streams_requests_is_one_answer_message_with_their_timing() -> None:
    """A batch answering requests from several stream messages goes back as one message; timings are per request."""
    held: list[tuple[list[Item], Deliver[Item, draft_pb2.DraftResponse]]] = []

    def hold(items: list[Item], deliver: Deliver[Item, draft_pb2.DraftResponse]) -> None:
        held.append((items, deliver))

    async def main() -> list[draft_pb2.DraftResponses]:
        feed, out = Feed(), []
        stream = serve_round_stream(
            feed.__aiter__(),
            hold,
            unpack=lambda m: m.requests,
            pack=lambda responses: draft_pb2.DraftResponses(responses=responses),
        )

        async def collect() -> None:
            async for message in stream:
                out.append(message)

        task = asyncio.ensure_future(collect())
        feed.put(_request("a", "propose"))
        feed.put(_request("b", "propose"), _request("c", "propose"))
        while len(held) < 2:
            await asyncio.sleep(0.01)
        items = held[0][0] + held[1][0]
        for s in items:
            s.started_ns, s.ended_ns = s.arrived_ns + 1_000_000, s.arrived_ns + 3_000_000  # 1 ms queued, 2 ms batch
        held[0][1](
            [(s, draft_pb2.DraftResponse(session_id=s.request.session_id)) for s in items]
        )  # the batch's one hand-off
        while not out:
            await asyncio.sleep(0.01)
        task.cancel()
        return out

    (message,) = asyncio.run(main())
    assert [r.session_id for r in message.responses] == ["a", "b", "c"]
    assert all(r.timing.queued_us == 1000 and r.timing.batch_us == 2000 for r in message.responses)
