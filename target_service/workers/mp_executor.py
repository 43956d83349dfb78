"""Followers as local processes (the `mp` executor, the default)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time

from target_service.workers.follower import run_follower
from target_service.workers.rendezvous import Rendezvous, WorkerSpec


class MpExecutor:
    """Followers as local processes (spawned: no fork of a process running torch and gRPC threads)."""

    name = "mp"

    def __init__(self) -> None:
        self._procs: list[tuple[int, multiprocessing.process.BaseProcess]] = []

    def advertise_host(self) -> str:
        return "127.0.0.1"

    def launch(self, spec: WorkerSpec, rdv: Rendezvous) -> None:
        ctx = multiprocessing.get_context("spawn")
        procs: list[tuple[int, multiprocessing.process.BaseProcess]] = []
        for rank in range(1, spec.tp):
            p = ctx.Process(target=run_follower, args=(spec, rank, rdv, "mp"), name=f"specd-tp-rank{rank}", daemon=True)
            p.start()
            procs.append((rank, p))
        self._procs = procs

    def dead(self) -> str | None:
        for rank, p in list(self._procs):
            if p.exitcode is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait_death(self, timeout_s: float) -> str | None:
        procs = list(self._procs)
        if procs:
            multiprocessing.connection.wait([p.sentinel for _, p in procs], timeout_s)
        else:
            time.sleep(timeout_s)
        return self.dead()

    def hint(self) -> str:
        return "the worker processes are still loading the model; their log lines are above"

    def stop(self, grace_s: float) -> None:
        procs, self._procs = self._procs, []
        deadline = time.monotonic() + grace_s
        for _, p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for _, p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5.0)

    def close(self) -> None:
        self.stop(0.0)
