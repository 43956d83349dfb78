"""Test harness: the three services as separate `specd serve` processes on 127.0.0.1.

Every process is started and stopped by the tests, with bounded waits. The
machinery lives in specd.tools.localcluster (shared with `specd bench`); this
module keeps the tests' defaults: one torch thread per service and a
coordinator that gives up on a slow draft quickly and retries it soon.

A cluster may borrow the target or the draft of another, running cluster
(`borrow_target=` / `borrow_draft=`, usually the session's `tiny_cluster`):
it then starts only what it does not borrow, its own coordinator at least,
and never stops or signals what it borrowed. A service forked from the test
process's fork server (tests/forkserver.py: specd imported once) skips the
3-4 CPU-s of imports a fresh interpreter pays (one still runs as such when an
environment variable the imports read differs). A test that
needs other coordinator flags, or breaks only its draft, still borrows the rest.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import CoordinatorClient
from specd.tools.localcluster import READY_TIMEOUT_S, LocalCluster, ServiceFailed, ServiceProcess, Spawn, _with_port
from tests.forkserver import shared_fork_server

__all__ = ["READY_TIMEOUT_S", "Borrowed", "Cluster", "QuietService", "_with_port"]


class QuietService(ServiceProcess):
    """One service process, forked from this test process's fork server unless told otherwise."""

    def __init__(self, name: str, args: list[str], *, echo: bool = False, spawn: Spawn | None = None) -> None:
        super().__init__(name, args, echo=echo, spawn=spawn or shared_fork_server().spawn)


class Borrowed(QuietService):
    """A running service of another cluster, lent to this one: its address and its log lines.

    It has no process of its own (`proc` is None), so this cluster neither starts,
    stops nor signals it; kill(), restart() and signal() fail, as they should in a
    test that borrowed what it breaks.
    """

    def __init__(self, lender: ServiceProcess) -> None:
        super().__init__(lender.name, lender.args)
        self.lender = lender
        self.lines = lender.lines  # the lender's relay appends to this very list

    def start(self, env: dict[str, str] | None = None) -> None:
        if not self.lender.ready:
            raise ServiceFailed(self.name, "was lent to this cluster but is not running", self.lender.tail())
        self.address = self.lender.address

    def failure(self) -> ServiceFailed | None:
        return self.lender.failure()

    def tail(self, n: int = 15) -> list[str]:
        return self.lender.tail(n)

    def peak_rss_bytes(self) -> int | None:
        return self.lender.peak_rss_bytes()

    def start_again(self, env: dict[str, str], args: list[str] | None = None) -> None:
        raise AssertionError(f"{self.name} is borrowed: a test that restarts it needs its own")

    def stop(self, grace_s: float) -> None:
        pass  # its lender's


class Cluster(LocalCluster):
    """target + optional draft + coordinator, each its own process."""

    def __init__(
        self,
        target_model: Path | str,
        draft_model: Path | str | None,
        *,
        cache_dir: Path,
        coordinator_args: list[str] | None = None,
        target_args: list[str] | None = None,
        draft_args: list[str] | None = None,
        borrow_target: Cluster | None = None,
        borrow_draft: Cluster | None = None,
    ) -> None:
        super().__init__(
            target_model,
            draft_model,
            cache_dir=cache_dir,
            target_threads=1,
            draft_threads=1,
            coordinator_args=["--draft-retry-s", "0.5", "--draft-timeout-s", "3", *(coordinator_args or [])],
            target_args=target_args or [],
            draft_args=draft_args or [],
            ready_timeout_s=READY_TIMEOUT_S,
            spawn=shared_fork_server().spawn,
        )
        if borrow_target is not None:
            assert target_args is None, "a borrowed target runs with its lender's flags"
            self.targets = [Borrowed(t) for t in borrow_target.targets]
            self.target = self.targets[0]
        if borrow_draft is not None:
            assert draft_model is not None and draft_args is None, (
                "a borrowed draft runs with its lender's model and flags"
            )
            self.drafts = [Borrowed(d) for d in borrow_draft.drafts]
            self.draft = self.drafts[0] if self.drafts else None

    def start(self) -> Cluster:
        super().start()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """The coordinator first (it drains its requests), then every draft and target at once.

        LocalCluster stops them one after another; each takes seconds to exit
        (interpreter teardown), and the peers do not depend on each other.
        """
        if self.coordinator is not None:
            self.coordinator.stop(grace_s=grace_s)
        stop_together([*self.drafts, *self.targets, self.target], grace_s)

    def client(self, timeout: float = 120.0) -> CoordinatorClient:
        return CoordinatorClient(self.address, timeout=timeout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def __enter__(self) -> Cluster:
        return self.start()


def stop_together(services: Iterable[QuietService | None], grace_s: float) -> None:
    """SIGTERM to each running service (by its pid), then SIGKILL to any still running after grace_s."""
    running = []
    for s in dict.fromkeys(x for x in services if x is not None):  # once each, in order
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            running.append(s.proc)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- metrics endpoints (services started with --metrics-port 0) -------------------------------

_METRICS_LINE = re.compile(r"^specd-(\w+) metrics on (\S+):(\d+)\s*$")


def metrics_address(service) -> str:
    for line in service.lines:
        if m := _METRICS_LINE.match(line):
            return f"{m.group(2)}:{m.group(3)}"
    raise AssertionError(f"{service.name} printed no metrics line:\n" + "".join(service.lines[-20:]))


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one metrics endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
