"""`specd up`: the three services as local processes, started in order, stopped together."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

_BANNER = re.compile(r"^(specd-\w+) listening on (\S+):(\d+)\s*$")


@dataclass
class ServiceProcess:
    """One `specd serve ...` child; its stdout is relayed with a name prefix."""

    name: str
    args: list[str]
    proc: subprocess.Popen[str] | None = None
    address: str | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd.tools.cli", "serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
        )
        # The thread gets this start's process and event: after a restart, the previous
        # process's relay, still draining, must not wake the new start's waiter.
        threading.Thread(
            target=self._relay, args=(self.proc, self._ready), daemon=True, name=f"relay-{self.name}"
        ).start()

    def _relay(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = _BANNER.match(line)
            if match and self.address is None:
                self.address = f"{match.group(2)}:{match.group(3)}"
                ready.set()
            self._on_line(line)
        ready.set()  # exited: wake the waiter

    def _on_line(self, line: str) -> None:
        """Each line the service prints (after the banner check): relayed to stderr."""
        sys.stderr.write(f"[{self.name}] {line}")

    def wait_ready(self, timeout: float) -> str:
        if not self._ready.wait(timeout) or self.address is None:
            code = self.proc.poll() if self.proc else None
            why = f"exited with code {code}" if code is not None else f"not ready after {timeout:.0f} s"
            raise RuntimeError(f"{self.name} service {why}; see its log lines above")
        return self.address

    def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
    ready_timeout_s: float = 600.0,
) -> int:
    """Start target, draft and coordinator; block until SIGINT/SIGTERM; stop all three."""
    common = ["--host", "127.0.0.1", "--port", "0"] + (["--cache-dir", cache_dir] if cache_dir else [])
    services: list[ServiceProcess] = [
        ServiceProcess(
            "target", ["target", "--model", target, "--torch-threads", str(target_threads), *common, *target_args]
        )
    ]
    if draft != "none":
        services.append(
            ServiceProcess(
                "draft",
                ["draft", "--model", draft, "--target-model", target, "--torch-threads", str(draft_threads), *common],
            )
        )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for service in services:
            service.start(env)
        addresses = {s.name: s.wait_ready(ready_timeout_s) for s in services}
        coordinator_args = [
            "coordinator",
            "--host",
            host,
            "--port",
            str(port),
            "--target",
            addresses["target"],
            "--draft",
            addresses.get("draft", "none"),
            "--tokenizer",
            target,
            "--draft-length",
            str(draft_length),
            *(["--cache-dir", cache_dir] if cache_dir else []),
            *extra_coordinator,
        ]
        coordinator = ServiceProcess("coordinator", coordinator_args)
        services.append(coordinator)
        coordinator.start(env)
        address = coordinator.wait_ready(ready_timeout_s)
        print(f"coordinator listening on {address}", flush=True)
        while not stop.is_set():
            if any(s.proc is not None and s.proc.poll() is not None for s in services):
                dead = [s.name for s in services if s.proc is not None and s.proc.poll() is not None]
                print(f"specd up: {', '.join(dead)} exited; stopping the rest", file=sys.stderr, flush=True)
                return 1
            stop.wait(0.5)
        return 0
    except RuntimeError as exc:
        print(f"specd up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for service in reversed(services):  # coordinator first: it drains its requests
            service.stop(grace_s=15.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        time.sleep(0)  # let relay threads flush
