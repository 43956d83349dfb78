"""Test harness: the three services as separate `specd serve` processes on 127.0.0.1.

Every process is started and stopped by the tests, with bounded waits. The
machinery lives in specd.tools.localcluster (shared with `specd bench`); this
module keeps the tests' defaults: one torch thread per service and a
coordinator that gives up on a slow draft quickly and retries it soon.
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
from specd.tools.localcluster import READY_TIMEOUT_S, LocalCluster, QuietService, _with_port

__all__ = ["READY_TIMEOUT_S", "Cluster", "QuietService", "_with_port"]


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
        )

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
