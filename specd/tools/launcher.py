"""`specd up`: the local cluster, supervised as Kubernetes would.

The three services are a LocalCluster (specd.tools.localcluster) with their
logs relayed, each forked from one fork server (specd.tools.forkserver) that
imported specd once: a start or restart pays no imports. Once all are ready, a service that exits is started again on
the port it had, after a backoff (1 s, doubling to 30 s; reset after 60 s of
running), while the others keep serving: with the draft down the coordinator
serves target-only, which is exact. Each state change prints one line.
SIGINT or SIGTERM stops everything (the coordinator first, so it drains).
With restart=False (`--no-restart`), the first exit stops the rest instead.

A service that exits before it is first ready is reported at once, with its
exit code and last lines, and nothing is restarted: that is a setup problem
(a missing package, an unreadable model) that a restart would not fix.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specd.tools.forkserver import ForkServer
from specd.tools.localcluster import LocalCluster, ServiceFailed, ServiceProcess, describe_exit

__all__ = ["Supervisor", "run_up"]

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0  # running this long without exiting clears the backoff


def _say(line: str) -> None:
    print(f"specd up: {line}", file=sys.stderr, flush=True)


@dataclass
class _Watch:
    """Supervision state of one service: 'up', 'waiting' (to restart at `due`) or 'starting'."""

    service: ServiceProcess
    state: str = "up"
    restarts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    due: float = 0.0
    up_since: float = 0.0


class Supervisor:
    """Restarts the services of a started LocalCluster that exit; one line per state change.

    step() does one pass and returns False when supervision must end (with
    restart off, once a service has exited); run() calls it until `stop` is set.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        restart: bool = True,
        say: Callable[[str], None] = _say,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.restart = restart
        self.say = say
        self.clock = clock
        now = clock()
        self.watches = [_Watch(s, up_since=now) for s in cluster.services]

    def step(self) -> bool:
        now = self.clock()
        for w in self.watches:
            s = w.service
            if w.state == "up":
                if s.running:
                    if now - w.up_since >= BACKOFF_RESET_AFTER_S:
                        w.backoff_s = BACKOFF_FIRST_S
                    continue
                code = describe_exit(s.returncode or 0)
                if not self.restart:
                    self.say(f"{s.name} exited with {code}; stopping the rest (--no-restart)")
                    return False
                self._wait(w, now, f"{s.name} exited with {code}")
            elif w.state == "waiting" and now >= w.due:
                w.restarts += 1
                w.state = "starting"
                self.say(f"{s.name} restarting (restart {w.restarts})")
                s.start_again(self.cluster.env)
            elif w.state == "starting":
                if s.ready:
                    w.state, w.up_since = "up", now
                    self.say(f"{s.name} ready on {s.address} (pid {s.pid}, restart {w.restarts})")
                elif s.returncode is not None:
                    self._wait(w, now, f"{s.name} exited with {describe_exit(s.returncode)} before it was ready")
        return True

    def _wait(self, w: _Watch, now: float, what: str) -> None:
        w.state, w.due = "waiting", now + w.backoff_s
        others = "; the others keep serving" + (
            " (target-only while the draft is down)" if w.service.name == "draft" else ""
        )
        self.say(f"{what}; restarting in {w.backoff_s:.0f} s{others}")
        w.backoff_s = min(BACKOFF_MAX_S, w.backoff_s * 2)

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> bool:
        """Supervise until `stop` is set (True) or, with restart off, a service exits (False)."""
        while not stop.is_set():
            if not self.step():
                return False
            stop.wait(poll_s)
        return True


def run_up(
    *,
    target: str,
    draft: str,
    host: str,
    port: int,
    cache_dir: str,
    draft_length: int,
    target_threads: int,
    draft_threads: int,
    extra_coordinator: Sequence[str] = (),
    target_args: Sequence[str] = (),
    restart: bool = True,
    ready_timeout_s: float = 600.0,
    target_replicas: int = 1,
    draft_replicas: int = 1,
    http_port: int = -1,
) -> int:
    """Start the targets, drafts and coordinator; supervise them until SIGINT/SIGTERM; stop them all.

    http_port: the coordinator's OpenAI HTTP API port (-1 off, 0 a free one), printed as
    `openai listening on HOST:PORT` after the coordinator's line."""
    forks = ForkServer()  # before any thread of this process: the server is a fresh interpreter
    cluster = LocalCluster(
        target,
        None if draft == "none" else draft,
        cache_dir=cache_dir or None,
        target_threads=target_threads,
        draft_threads=draft_threads,
        coordinator_threads=1,
        coordinator_args=["--draft-length", str(draft_length), "--http-port", str(http_port), *extra_coordinator],
        target_args=target_args,
        host=host,
        port=port,
        ready_timeout_s=ready_timeout_s,
        echo=True,
        target_replicas=target_replicas,
        draft_replicas=draft_replicas,
        spawn=forks.spawn,
    )
    stop = threading.Event()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # while starting: LocalCluster.start stops what it started

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        what = _count(target_replicas, "target") + (
            "" if draft == "none" else " and " + _count(draft_replicas, "draft")
        )
        _say(f"starting {what}, then the coordinator")
        try:
            cluster.start()
        except ServiceFailed as exc:
            _say(str(exc))
            return 1
        except KeyboardInterrupt:
            _say("interrupted while starting; stopped")
            return 130
        for sig in previous:
            signal.signal(sig, lambda *_: stop.set())
        for service in cluster.services:
            _say(f"{service.name} ready on {service.address} (pid {service.pid})")
        print(f"coordinator listening on {cluster.address}", flush=True)
        assert cluster.coordinator is not None
        if cluster.coordinator.http_address is not None:
            print(f"openai listening on {cluster.coordinator.http_address}", flush=True)
        supervised = Supervisor(cluster, restart=restart).run(stop)
        if supervised:
            _say("stopping")
        return 0 if supervised else 1
    finally:
        cluster.stop(grace_s=15.0)  # coordinator first: it drains its requests
        forks.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _count(n: int, role: str) -> str:
    return role if n == 1 else f"{n} {role} replicas"
