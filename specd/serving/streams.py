"""Server side of a round stream: requests in order, handled off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def serve_round_stream(
    requests: AsyncIterator[Req],
    submit: Callable[[Req], Future[Resp]],
    *,
    max_pending: int = 256,
) -> AsyncIterator[Resp]:
    """Hand each request to `submit` (the model thread's batcher), yield responses in order.

    At most max_pending requests wait at once; beyond that the stream stops
    reading, so gRPC flow control pushes back on the sender (no unbounded queue).
    Written as an async generator (the OpenTelemetry aio instrumentor needs it).
    """
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[asyncio.Future[Resp] | None] = asyncio.Queue(max_pending)

    async def read() -> None:
        try:
            async for request in requests:
                await pending.put(asyncio.wrap_future(submit(request), loop=loop))
        finally:
            await pending.put(None)

    reader = asyncio.create_task(read())
    try:
        while (future := await pending.get()) is not None:
            yield await future
        await reader  # re-raise a broken stream's error, if any
    finally:
        reader.cancel()
