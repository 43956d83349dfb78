"""Continuous batching on a model thread: whatever is queued when the thread is free runs together.

Requests from every stream and session are submitted here. The model thread
takes all that are waiting (up to `max_batch`), hands them to `handle_batch`
as one list and resolves each request's future with its own response; what
arrives meanwhile forms the next batch. Nothing waits for a batch to fill:
one request alone runs at once, and under load batches form by themselves.
So a session joins or leaves between any two batches, and no request waits
for another session longer than one batch's run (the bound).

`max_batch = 1` turns batching off (one request per call, as before).

Cohorts: with no wait at all, sessions split into groups that take turns
(while group A runs, group B queues; when A's sessions send again, B is
already running), so every round of all sessions costs two passes. With
`max_wait_s` > 0 a batch smaller than `expected()` (the sessions the
service holds) waits up to that long for more requests before it runs, so
the groups merge; the bound on waiting grows by max_wait_s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Generic, TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

log = logging.getLogger(__name__)


class MicroBatcher(Generic[Req, Resp]):
    """Submit single requests; `handle_batch` sees them in batches, in arrival order."""

    def __init__(
        self,
        handle_batch: Callable[[Sequence[Req]], Sequence[Resp]],
        executor: Executor,
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.0,
        expected: Callable[[], int] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0 (got {max_wait_s})")
        self._handle_batch = handle_batch
        self._executor = executor  # one thread: the model's
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._expected = expected
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[tuple[Req, Future[Resp]]] = deque()
        self._scheduled = False  # a drain is queued or running on the executor

    def submit(self, request: Req) -> Future[Resp]:
        future: Future[Resp] = Future()
        with self._lock:
            self._queue.append((request, future))
            self._arrived.notify()
            if self._scheduled:
                return future
            self._scheduled = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError as exc:  # executor shut down: the service is stopping
            with self._lock:
                self._scheduled = False
                self._queue.clear()
            future.set_exception(exc)
        return future

    def withdraw(self, match: Callable[[Req], bool], answer: Callable[[Req], Resp]) -> int:
        """Take the queued requests that `match` out of the queue, unrun, each answered with answer(request).

        For work no one waits for any more (its session closed): it never reaches the model
        thread. A request already in a running batch is not queued and runs to its end.
        """
        with self._lock:
            taken = [(r, f) for r, f in self._queue if match(r)]
            if taken:
                kept = [(r, f) for r, f in self._queue if not match(r)]
                self._queue.clear()
                self._queue.extend(kept)
        for r, f in taken:
            if f.set_running_or_notify_cancel():
                f.set_result(answer(r))
        return len(taken)

    @property
    def queued(self) -> int:
        """Requests waiting for the model thread (a replica's queue, for load reports)."""
        with self._lock:
            return len(self._queue)

    def _drain(self) -> None:
        """Run batches until the queue is empty (on the model thread)."""
        while True:
            with self._lock:
                if not self._queue:
                    self._scheduled = False
                    return
                self._wait_for_more()
                n = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
            requests = [r for r, _ in batch]
            try:
                responses = self._handle_batch(requests)
                if len(responses) != len(requests):
                    raise RuntimeError(f"handle_batch returned {len(responses)} responses for {len(requests)} requests")
            except BaseException as exc:
                log.exception("batch of %d failed", len(requests))
                for _, f in batch:
                    if f.set_running_or_notify_cancel():
                        f.set_exception(exc)
                continue
            for (_, f), resp in zip(batch, responses):
                if f.set_running_or_notify_cancel():
                    f.set_result(resp)

    def _wait_for_more(self) -> None:
        """Hold a small batch up to max_wait_s for the requests the held sessions may still send (lock held)."""
        if self.max_wait_s <= 0 or self._expected is None or self.max_batch == 1:
            return
        want = min(self.max_batch, self._expected())
        deadline = time.monotonic() + self.max_wait_s
        while len(self._queue) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._arrived.wait(left)
