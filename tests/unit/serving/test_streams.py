"""The server side of a round stream (specd.serving.streams), without gRPC: order, and the drain on shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future

from specd.serving.streams import Stamped, StreamScope, serve_round_stream
from specd.v1 import draft_pb2


def _request(session: str, op: str) -> draft_pb2.DraftRequest:
    req = draft_pb2.DraftRequest(session_id=session)
    getattr(req, op).SetInParent()
    return req


def _answer(stamped: Stamped[draft_pb2.DraftRequest]) -> Future[draft_pb2.DraftResponse]:
    done: Future[draft_pb2.DraftResponse] = Future()
    done.set_result(draft_pb2.DraftResponse(session_id=stamped.request.session_id))
    return done


class Feed:
    """A request stream the test writes to, as a coordinator would; it never ends by itself."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[draft_pb2.DraftRequest] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[draft_pb2.DraftRequest]:
        while True:
            yield await self.queue.get()


async def _collect(stream: AsyncIterator[draft_pb2.DraftResponse], into: list[str]) -> None:
    async for resp in stream:
        into.append(resp.session_id)


def test_a_draining_stream_serves_its_open_sessions_and_ends_when_the_last_one_closes() -> None:
    async def main() -> None:
        feed, drain, got = Feed(), asyncio.Event(), []
        scope = StreamScope()
        stream = serve_round_stream(
            feed.__aiter__(), _answer, scope=scope, make_request=draft_pb2.DraftRequest, drain=drain
        )
        task = asyncio.ensure_future(_collect(stream, got))
        for op in ("open", "propose"):
            feed.queue.put_nowait(_request("a", op))
        await asyncio.sleep(0.05)
        drain.set()  # shutting down with session a open: it goes on
        feed.queue.put_nowait(_request("a", "propose"))
        await asyncio.sleep(0.05)
        assert not task.done() and got == ["a", "a", "a"]
        feed.queue.put_nowait(_request("a", "close"))  # the request is done: the stream ends after answering it
        await asyncio.wait_for(task, 5)
        assert got == ["a"] * 4 and not scope.open

    asyncio.run(main())


def test_an_idle_stream_ends_as_soon_as_the_service_drains() -> None:
    async def main() -> None:
        feed, drain, got = Feed(), asyncio.Event(), []
        stream = serve_round_stream(
            feed.__aiter__(), _answer, scope=StreamScope(), make_request=draft_pb2.DraftRequest, drain=drain
        )
        task = asyncio.ensure_future(_collect(stream, got))
        for op in ("open", "close"):
            feed.queue.put_nowait(_request("b", op))
        await asyncio.sleep(0.05)
        assert not task.done()  # no drain yet: an idle stream stays up
        drain.set()
        await asyncio.wait_for(task, 5)
        assert got == ["b", "b"]

    asyncio.run(main())


def test_without_a_drain_a_stream_answers_in_order_and_ends_with_its_requests() -> None:
    async def requests() -> AsyncIterator[draft_pb2.DraftRequest]:
        for i in range(300):  # more than max_pending: the stream reads on as it answers
            yield _request(f"s{i}", "propose")

    async def main() -> list[str]:
        got: list[str] = []
        await asyncio.wait_for(_collect(serve_round_stream(requests(), _answer, max_pending=8), got), 10)
        return got

    assert asyncio.run(main()) == [f"s{i}" for i in range(300)]
