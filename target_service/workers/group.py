"""Rank 0's side of the worker group: form it, send it commands, watch it, restart it.

A follower that exits is seen by a monitor thread (process sentinel / Ray
task), and a collective that raises on rank 0 marks the group failed too.
Then: health goes NOT_SERVING, every runner call fails at once with
Unavailable (the servicer sends CODE_UNAVAILABLE in-band; the coordinator
retries within its budget), and the supervisor thread tears the group down
and forms a new one (new followers, new store, new process group; rank 0
keeps its loaded shard) with backoff, then SERVING again. Sessions survive
on rank 0 and are recomputed on the next forward. With
--exit-on-worker-failure the process exits (code 3) for Kubernetes to
restart it instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from specd.core.errors import FailedPrecondition, Unavailable
from target_service.workers.commands import STOP, Command, broadcast
from target_service.workers.executor import Executor
from target_service.workers.rendezvous import Rendezvous, WorkerSpec, destroy_groups, init_groups, master_store

log = logging.getLogger(__name__)

EXIT_WORKER_FAILURE = 3  # process exit code with --exit-on-worker-failure
_RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest pause between restart attempts


class WorkerGroup:
    """Rank 0's side of the group: forms it, sends commands, watches it, restarts it.

    Thread model: the model thread sends commands and runs forwards inside
    `collective()` (holding `_lock`); a monitor thread per generation waits for
    follower deaths; one supervisor thread rebuilds the group after a failure.
    """

    READY, FAILED, STARTING, CLOSED = "ready", "failed", "starting", "closed"

    def __init__(self, spec: WorkerSpec, executor: Executor, *, exit_on_failure: bool = False) -> None:
        self.spec = spec
        self.executor = executor
        self.exit_on_failure = exit_on_failure
        self.state = self.STARTING
        self.generation = 0
        self.workers: list[dict[str, Any]] = []  # ready info of ranks 1..N-1 (pid, bytes, device)
        self.restarts = 0
        self.on_health: Callable[[bool], None] | None = None  # called from the supervisor thread
        self.on_fatal: Callable[[str], None] | None = None  # must end the process
        self._reason = ""
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._closing = threading.Event()
        self._commands: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._monitor_stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------

    def start(self, while_loading: Callable[[], None] | None = None) -> None:
        """Launch the followers, run `while_loading` (rank 0's own load), wait for all; raise on failure."""
        try:
            self._form(while_loading)
        except BaseException:
            self._teardown()
            self.executor.close()
            self.state = self.CLOSED
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="specd-tp-supervisor", daemon=True)
        self._supervisor.start()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the followers (politely, then by force) and free the process group."""
        if self.state == self.CLOSED:
            return
        self._closing.set()
        self._failed.set()  # wake the supervisor so it can exit
        if self._lock.acquire(timeout=grace_s):
            try:
                if self.state == self.READY and self._commands is not None:
                    try:
                        broadcast(STOP, self._commands)
                    except Exception as exc:  # noqa: BLE001 - followers may be gone
                        log.debug("stop command: %s", exc)
                self.state = self.CLOSED
                self._teardown(grace_s)
            finally:
                self._lock.release()
        else:
            self.state = self.CLOSED
            self.executor.stop(0.0)
        self.executor.close()

    def fail(self, reason: str, generation: int | None = None) -> None:
        """Mark the group failed (any thread); the supervisor restarts it. Stale reports are ignored."""
        if generation is not None and generation != self.generation:
            return
        if self.state != self.READY:
            return
        self._reason = reason
        self.state = self.FAILED
        log.error("tensor-parallel worker group failed: %s", reason)
        self._failed.set()

    # ---- the model thread ---------------------------------------------------------------

    def unavailable(self) -> Unavailable:
        if self.state == self.CLOSED:
            return Unavailable("the target is shutting down")
        return Unavailable(f"the tensor-parallel worker group is restarting ({self._reason}); retry shortly")

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Run rank 0's side of a command + forward; any failure fails the group and raises Unavailable."""
        if self.state != self.READY:
            raise self.unavailable()
        with self._lock:
            if self.state != self.READY:
                raise self.unavailable()
            generation = self.generation
            try:
                yield
            except BaseException as exc:
                # The followers may be mid-forward: the group is out of step either way.
                first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
                self.fail(f"rank 0: {type(exc).__name__}: {first_line}", generation)
                raise self.unavailable() from exc

    def send(self, command: Command) -> None:
        """Broadcast one command to the followers (call inside `collective()`)."""
        broadcast(command, self._commands)

    # ---- forming and restarting -----------------------------------------------------

    def _form(self, while_loading: Callable[[], None] | None = None) -> None:
        spec = self.spec
        generation = self.generation + 1
        store = master_store(self.executor.advertise_host(), spec.ready_timeout_s)
        rdv = Rendezvous(self.executor.advertise_host(), store.port, generation)
        log.info(
            "starting %d tensor-parallel workers (%s executor, generation %d)",
            spec.tp - 1,
            self.executor.name,
            generation,
        )
        self.executor.launch(spec, rdv)
        deadline = time.monotonic() + spec.ready_timeout_s
        if while_loading is not None:
            while_loading()
        workers = self._wait_ready(store, deadline)
        commands = init_groups(spec, store, 0)
        self._store, self._commands, self.workers = store, commands, workers
        self.generation = generation
        self._monitor_stop = threading.Event()
        threading.Thread(
            target=self._monitor,
            args=(generation, self._monitor_stop),
            name=f"specd-tp-monitor-{generation}",
            daemon=True,
        ).start()
        for w in workers:  # before READY: health says SERVING only once the log names the new workers
            log.info(
                "tp worker rank %d ready: pid %d on %s (%s), %d bytes of sharded weights",
                w["rank"],
                w["pid"],
                w["host"],
                w["device"],
                w["sharded_bytes"],
            )
        self.state = self.READY

    def _wait_ready(self, store: dist.TCPStore, deadline: float) -> list[dict[str, Any]]:
        pending = set(range(1, self.spec.tp))
        ready: dict[int, dict[str, Any]] = {}

        def check_errors() -> None:
            for rank in sorted(pending):
                if store.check([f"error/{rank}"]):
                    raise FailedPrecondition(
                        f"tensor-parallel rank {rank} could not load its shard: {store.get(f'error/{rank}').decode()}"
                    )

        while pending:
            check_errors()
            for rank in sorted(pending):
                if store.check([f"ready/{rank}"]):
                    ready[rank] = json.loads(store.get(f"ready/{rank}"))
                    pending.discard(rank)
            if not pending:
                break
            why = self.executor.dead()
            if why is not None:
                check_errors()
                raise Unavailable(f"tensor-parallel worker {why} before it was ready; see its log")
            if time.monotonic() > deadline or self._closing.is_set():
                raise Unavailable(
                    f"tensor-parallel ranks {sorted(pending)} were not ready after {self.spec.ready_timeout_s:.0f} s: "
                    f"{self.executor.hint()}; raise --worker-ready-timeout-s if loading is only slow"
                )
            time.sleep(0.05)
        return [ready[r] for r in sorted(ready)]

    def _teardown(self, grace_s: float = 0.0) -> None:
        self._monitor_stop.set()
        self.executor.stop(grace_s)
        destroy_groups()
        self._commands, self._store = None, None

    def _monitor(self, generation: int, stop: threading.Event) -> None:
        while not stop.is_set():
            why = self.executor.wait_death(0.5)
            if why is not None and not stop.is_set():
                self.fail(why, generation)
                return

    def _health(self, serving: bool) -> None:
        if self.on_health is not None:
            try:
                self.on_health(serving)
            except Exception:
                log.exception("health callback failed")

    def _supervise(self) -> None:
        while True:
            self._failed.wait()
            if self._closing.is_set():
                return
            self._health(False)
            with self._lock:  # waits for the model thread's failing call to return
                self._teardown()
            if self.exit_on_failure:
                log.critical(
                    "tensor-parallel worker failed (%s); exiting for a restart (--exit-on-worker-failure)", self._reason
                )
                if self.on_fatal is not None:
                    self.on_fatal(self._reason)
                else:
                    os._exit(EXIT_WORKER_FAILURE)
                return
            pause = _RESTART_BACKOFF_S[0]
            while not self._closing.is_set():
                try:
                    self._failed.clear()
                    with self._lock:
                        self._form()
                    break
                except Exception as exc:  # noqa: BLE001 - retried with backoff; health stays NOT_SERVING
                    log.error("restarting the tensor-parallel workers failed: %s; retrying in %.0f s", exc, pause)
                    with self._lock:
                        self._teardown()
                    self._closing.wait(pause)
                    pause = min(pause * 2, _RESTART_BACKOFF_S[1])
            if self._closing.is_set():
                return
            self.restarts += 1
            log.info("tensor-parallel worker group restarted (generation %d)", self.generation)
            self._health(True)
