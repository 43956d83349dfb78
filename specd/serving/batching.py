"""Continuous batching on a model thread: whatever is queued when the thread is free runs together.

Requests from every stream and session are submitted here, a stream message's
requests at once, each with the `Deliver` callback of the stream it came on.
The model thread takes all that are waiting (up to `max_batch`), hands them to
`handle_batch` as one list, and hands the answers back once per stream and
batch: one call of each stream's Deliver with all of that stream's answers
(so a stream pays one wake-up of its event loop per batch, not one per
request). What arrives meanwhile forms the next batch. Nothing waits for a
batch to fill: one request alone runs at once, and under load batches form by
themselves. So a session joins or leaves between any two batches, and no
request waits for another session longer than one batch's run (the bound).

`max_batch = 1` turns batching off (one request per call, as before).

`idle` (optional): called on the model thread when the queue is empty, again
while it returns True and nothing has arrived (the draft's head start on its
next branch call, specd.core.draft.model_drafter.ModelDrafter.idle). A request
arriving meanwhile waits for the call under way, then runs.

`after_deliver` (optional): called on the model thread after each batch's answers are handed
on, with whether more requests are queued: work that must not hold an answer back (a message's
span and metrics, BatchedRoundServicer) runs there, or beside the next batch's pass when one is
queued.

handle_batch may answer a request with LATER: it keeps the request and answers
it itself, through the request's Deliver, once it can (the target's staged
verifies wait for a verdict this way).

Cohorts: with no wait at all, sessions split into groups that take turns
(while group A runs, group B queues; when A's sessions send again, B is
already running), so every round of all sessions costs two passes. With
`max_wait_s` > 0 a batch smaller than `expected()` (the sessions the
service holds) waits up to that long for more requests before it runs, so
the groups merge; the bound on waiting grows by max_wait_s.

Waits that merge nobody (nothing arrives before max_wait_s runs out),
`FRUITLESS_RUN` in a row, say the missing sessions are a phase away (their
steps at the other service, or no step coming), not a moment late: the next
`FRUITLESS_SKIP` batches run at once, then a wait is tried again, and one
that merges someone ends the run. Emulated h100-tp2-70b, 32 streams, K = 4:
32 sessions split 30 + 2 and each batch waited the whole 3 ms for the other
group, every round (docs/results/batch-wait-2026-12-06/). One fruitless wait
alone proves little: on the real demo pair at 8 clients a new request's
session misses a wait now and then while the others' waits merge stragglers,
and skipping after every fruitless wait cost 3-13% there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Generic, TypeAlias, TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# A stream's answers: (request, its response, or the error that failed its whole batch).
Answered: TypeAlias = list[tuple[Req, Resp | BaseException]]
Deliver: TypeAlias = Callable[[Answered[Req, Resp]], None]  # called once per batch with a stream's answers


class Later:
    """handle_batch's answer for a request it will answer itself, later, through its stream's Deliver."""

    def __repr__(self) -> str:
        return "LATER"


LATER = Later()  # the one instance (immutable)

log = logging.getLogger(__name__)

FRUITLESS_RUN = 4  # waits in a row that merged nobody ...
FRUITLESS_SKIP = 8  # ... then this many batches run without waiting (see the module docstring)


class MicroBatcher(Generic[Req, Resp]):
    """Submit a stream message's requests with their stream's Deliver; `handle_batch` sees them in batches, in order."""

    def __init__(
        self,
        handle_batch: Callable[[Sequence[Req]], Sequence[Resp | Later]],
        executor: Executor,
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.0,
        expected: Callable[[], int] | None = None,
        idle: Callable[[], bool] | None = None,
        after_deliver: Callable[[bool], None] | None = None,
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
        self.idle = idle  # work for the model thread when nothing is queued; True: it did some, ask again
        self.after_deliver = after_deliver  # after each batch's answers went out: its argument, more are queued
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[tuple[Req, Deliver[Req, Resp]]] = deque()
        self._scheduled = False  # a drain is queued or running on the executor
        self._fruitless = 0  # waits in a row that merged nobody
        self._skip_waits = 0  # batches left to run without waiting (after FRUITLESS_RUN fruitless waits)

    def submit(self, requests: Sequence[Req], deliver: Deliver[Req, Resp]) -> None:
        """Queue requests (one stream's, in order); their answers come to `deliver`, once per batch that ran any.

        deliver is called on the model thread (or, if the executor has shut down, here, with
        the error for every request); it must only hand the answers on, not block.
        """
        if not requests:
            return
        with self._lock:
            self._queue.extend((r, deliver) for r in requests)
            self._arrived.notify()
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError as exc:  # executor shut down: the service is stopping
            with self._lock:
                self._scheduled = False
                failed = list(self._queue)
                self._queue.clear()
            self._deliver([(r, d, exc) for r, d in failed])

    def submit_one(self, request: Req) -> Future[Resp]:
        """One request, its answer as a Future (tests, and callers outside a stream)."""
        future: Future[Resp] = Future()

        def deliver(answered: Answered[Req, Resp]) -> None:
            ((_, result),) = answered
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        self.submit([request], deliver)
        return future

    def withdraw(self, match: Callable[[Req], bool], answer: Callable[[Req], Resp]) -> int:
        """Take the queued requests that `match` out of the queue, unrun, each answered with answer(request).

        For work no one waits for any more (its session closed): it never reaches the model
        thread. A request already in a running batch is not queued and runs to its end. The
        answers go to each request's Deliver at once, from the calling thread.
        """
        with self._lock:
            taken = [(r, d) for r, d in self._queue if match(r)]
            if taken:
                kept = [(r, d) for r, d in self._queue if not match(r)]
                self._queue.clear()
                self._queue.extend(kept)
        self._deliver([(r, d, answer(r)) for r, d in taken])
        return len(taken)

    @property
    def queued(self) -> int:
        """Requests waiting for the model thread (a replica's queue, for load reports)."""
        with self._lock:
            return len(self._queue)

    def _drain(self) -> None:
        """Run batches until the queue is empty, then the idle work until it has none (on the model thread)."""
        idle_done = False
        while True:
            with self._lock:
                if not self._queue:
                    if self.idle is None or idle_done:
                        self._scheduled = False
                        return
                    batch = []
                else:
                    self._wait_for_more()
                    n = min(len(self._queue), self.max_batch)
                    batch = [self._queue.popleft() for _ in range(n)]
            if not batch:
                idle_done = not self._run_idle()
                continue
            idle_done = False
            requests = [r for r, _ in batch]
            results: Sequence[Resp | Later | BaseException]
            try:
                results = self._handle_batch(requests)
                if len(results) != len(requests):
                    raise RuntimeError(f"handle_batch returned {len(results)} responses for {len(requests)} requests")
            except BaseException as exc:
                log.exception("batch of %d failed", len(requests))
                results = [exc] * len(requests)
            self._deliver([(r, d, result) for (r, d), result in zip(batch, results) if result is not LATER])
            if self.after_deliver is not None:
                with self._lock:
                    queued = bool(self._queue)
                try:
                    self.after_deliver(queued)
                except Exception:  # the model thread goes on serving
                    log.exception("the work after a batch's answers failed")

    def _run_idle(self) -> bool:
        """One call of the idle work; False when it had none (or failed: it is only a head start)."""
        assert self.idle is not None
        try:
            return bool(self.idle())
        except Exception:  # the model thread goes on serving
            log.exception("idle work failed")
            return False

    @staticmethod
    def _deliver(answered: Sequence[tuple[Req, Deliver[Req, Resp], Any]]) -> None:
        """Each stream's answers to its Deliver, in one call per stream (in request order)."""
        by_stream: dict[int, tuple[Deliver[Req, Resp], Answered[Req, Resp]]] = {}
        for request, deliver, result in answered:
            by_stream.setdefault(id(deliver), (deliver, []))[1].append((request, result))
        for deliver, items in by_stream.values():
            try:
                deliver(items)
            except Exception:  # one stream's hand-off must not stop the model thread
                log.exception("handing %d answers to their stream failed", len(items))

    def _wait_for_more(self) -> None:
        """Hold a small batch up to max_wait_s for the requests the held sessions may still send (lock held)."""
        if self.max_wait_s <= 0 or self._expected is None or self.max_batch == 1:
            return
        if self._skip_waits > 0:
            self._skip_waits -= 1
            return
        want = min(self.max_batch, self._expected())
        had = len(self._queue)
        if had >= want:
            return
        deadline = time.monotonic() + self.max_wait_s
        while len(self._queue) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._arrived.wait(left)
        if len(self._queue) > had:
            self._fruitless = 0
            return
        self._fruitless += 1  # nobody came
        if self._fruitless >= FRUITLESS_RUN:  # the rest are a phase away: stop waiting a while
            self._skip_waits = FRUITLESS_SKIP
