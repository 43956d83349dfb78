"""target + draft + coordinator as local `specd serve` processes, started and stopped together.

The base of `specd up` (specd.tools.launcher adds supervision), `specd bench`
(which starts its own services) and the tests (tests/cluster.py). Each
service's log lines are kept in memory (`ServiceProcess.lines`, the last
MAX_LINES) and, with echo, relayed to stderr with a name prefix. A service
that exits before it is ready is reported at once, with its exit code and
its last lines.

    with LocalCluster(target_dir, draft_dir, target_threads=2) as cluster:
        with cluster.client() as client:
            print(client.generate("Hello", max_new_tokens=8).text)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Protocol

from coordinator.client import CoordinatorClient

__all__ = [
    "READY_TIMEOUT_S",
    "LocalCluster",
    "QuietService",
    "ServiceFailed",
    "ServiceHandle",
    "ServiceProcess",
    "process_tree_peak_rss",
    "wait_all_ready",
]

READY_TIMEOUT_S = 120.0
MAX_LINES = 10_000  # log lines kept per service (older ones are dropped)
TAIL_LINES = 15  # log lines shown when a service fails

_BANNER = re.compile(r"^(specd-\w+) listening on (\S+):(\d+)\s*$")
_OPENAI_LINE = re.compile(r"^specd-\w+ openai on (\S+):(\d+)\b")  # the coordinator's HTTP API (--http-port)


class ServiceFailed(RuntimeError):
    """A service exited before it was ready, or was not ready in time; says which, with its last lines."""

    def __init__(self, name: str, why: str, tail: Sequence[str]) -> None:
        last = "".join(f"  {line}" for line in tail) or "  (it printed nothing)\n"
        super().__init__(f"{name} service {why}; its last lines:\n{last.rstrip()}")
        self.name = name
        self.why = why


class ServiceProcess:
    """One `specd serve ...` child, started (and restarted) on demand.

    Its output (stdout and stderr) is read line by line by a thread: the
    banner "specd-NAME listening on HOST:PORT" gives its address, and the
    lines are kept (and echoed to stderr when echo is set).
    """

    def __init__(self, name: str, args: list[str], *, echo: bool = False, spawn: Spawn | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.echo = echo
        self.spawn = spawn or popen_service
        self.ready_timeout_s = READY_TIMEOUT_S
        self.proc: ServiceHandle | None = None
        self.address: str | None = None
        self.http_address: str | None = None  # the OpenAI HTTP API's HOST:PORT, when it serves one
        self.lines: list[str] = []
        self.started_at = 0.0
        self._lock = threading.Lock()
        self._ready = threading.Event()  # set by the banner or by the exit of the current process

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start the process (non-blocking); wait_ready() waits for its banner."""
        self.address = None
        self.http_address = None
        self._ready = threading.Event()
        self.started_at = time.monotonic()
        self.proc = self.spawn(["serve", *self.args], env)
        threading.Thread(
            target=self._relay, args=(self.proc, self._ready), daemon=True, name=f"relay-{self.name}"
        ).start()

    def _relay(self, proc: ServiceHandle, ready: threading.Event) -> None:
        # proc and ready are this start's: a relay still draining a previous process cannot touch the next.
        assert proc.stdout is not None
        for line in proc.stdout:
            if proc is self.proc and (http := _OPENAI_LINE.match(line)):  # printed before the banner
                self.http_address = f"{http.group(1)}:{http.group(2)}"
            match = _BANNER.match(line)
            if match and proc is self.proc and self.address is None:
                self.address = f"{match.group(2)}:{match.group(3)}"
                ready.set()
            self._on_line(line)
        proc.wait()  # stdout closes just before exit: have the exit code before waking the waiter
        ready.set()

    def _on_line(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
            if len(self.lines) > 2 * MAX_LINES:
                del self.lines[:-MAX_LINES]
        if self.echo:
            sys.stderr.write(f"[{self.name}] {line}")
            sys.stderr.flush()

    def tail(self, n: int = TAIL_LINES) -> list[str]:
        with self._lock:
            return self.lines[-n:]

    @property
    def returncode(self) -> int | None:
        """The exit code of the current process once it has exited (negative: killed by that signal)."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        """Printed its banner and still running."""
        return self.address is not None and self.running

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def failure(self) -> ServiceFailed | None:
        """The ServiceFailed to report if the current process exited before it was ready, else None."""
        code = self.returncode
        if code is None or self.address is not None:
            return None
        return ServiceFailed(self.name, f"exited with {describe_exit(code)} before it was ready", self.tail())

    def wait_ready(self, timeout: float | None = None) -> str:
        """The service's address once it is ready; ServiceFailed at once if it exits first, or after timeout."""
        timeout = self.ready_timeout_s if timeout is None else timeout
        self._ready.wait(timeout)
        if self.address is not None:
            return self.address
        failed = self.failure()
        if failed is not None:
            raise failed
        raise ServiceFailed(self.name, f"not ready after {timeout:.0f} s (still running)", self.tail())

    def restart(self, env: dict[str, str], args: list[str] | None = None) -> str:
        """Start again (after a kill) on the same port, so peers reconnect to it; wait until ready."""
        self.start_again(env, args)
        return self.wait_ready(self.ready_timeout_s)

    def start_again(self, env: dict[str, str], args: list[str] | None = None) -> None:
        """Start again on the port it had (non-blocking)."""
        if args is not None:
            self.args = args
        port = self.address.rsplit(":", 1)[1] if self.address else None
        if port is not None and "--port" in self.args:
            self.args = _with_port(self.args, port)
        http_port = self.http_address.rsplit(":", 1)[1] if self.http_address else None
        if http_port is not None and "--http-port" in self.args:  # the same HTTP port too
            self.args = _with_port(self.args, http_port, flag="--http-port")
        self.start(env)

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after grace_s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def peak_rss_bytes(self) -> int | None:
        """Peak resident memory (VmHWM) of the process and its descendants (e.g. tp workers), summed.

        None when the process is gone or /proc is not available. Read it
        before stopping the service: a reaped process has no /proc entry.
        """
        if self.proc is None or self.proc.poll() is not None:
            return None
        return process_tree_peak_rss(self.proc.pid)


QuietService = ServiceProcess  # the name the tests and scripts use (echo off by default)


class ServiceHandle(Protocol):
    """What ServiceProcess uses of a started service: the part of subprocess.Popen a fork server can give too."""

    @property
    def pid(self) -> int: ...
    @property
    def stdout(self) -> IO[str] | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


# spawn(specd's arguments, env): the running service, its output (stdout and stderr) as text lines on
# .stdout, in a session of its own. The default runs a fresh interpreter; `specd up` and the tests fork theirs
# from one that has imported specd already (specd.tools.forkserver).
Spawn = Callable[[list[str], "dict[str, str] | None"], ServiceHandle]


def popen_service(argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[str]:
    """`python -m specd.tools.entry ARGV...` in a new session, stdout and stderr on one text pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "specd.tools.entry", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the parent only; it stops the children in order
    )


def describe_exit(code: int) -> str:
    """'code 1', or 'signal SIGKILL' for a negative Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def wait_all_ready(services: Sequence[ServiceProcess], timeout: float) -> None:
    """Wait until every service is ready; raise the first failure as soon as it happens."""
    deadline = time.monotonic() + timeout
    pending = list(services)
    while pending:
        for service in list(pending):
            failed = service.failure()
            if failed is not None:
                raise failed
            if service.address is not None:
                pending.remove(service)
        if not pending:
            return
        if time.monotonic() >= deadline:
            s = pending[0]
            raise ServiceFailed(s.name, f"not ready after {timeout:.0f} s (still running)", s.tail())
        pending[0]._ready.wait(0.1)


def _with_port(args: list[str], port: str, flag: str = "--port") -> list[str]:
    out = list(args)
    out[len(out) - 1 - out[::-1].index(flag) + 1] = port  # the last one: later flags win
    return out


def peak_rss_of(pid: int) -> int | None:
    """VmHWM (peak resident set size) of one process in bytes, from /proc/<pid>/status."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                    out.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return out


def process_tree_peak_rss(pid: int) -> int | None:
    """Sum of VmHWM over pid and its descendants (each process's own peak; they need not coincide)."""
    own = peak_rss_of(pid)
    if own is None:
        return None
    total, stack, seen = own, _children(pid), {pid}
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        total += peak_rss_of(child) or 0
        stack.extend(_children(child))
    return total


def _replica_name(role: str, index: int, count: int) -> str:
    """'target' for a lone replica, 'target-1', 'target-2', ... for several."""
    return role if count == 1 else f"{role}-{index + 1}"


class LocalCluster:
    """target + optional draft + coordinator, each its own `specd serve` process.

    target_model / draft_model: what the services' --model takes (a folder, 'demo';
    the draft also 'ngram'); draft_model None runs without a draft.
    cache_dir: exported as SPECD_CACHE_DIR to the services (None: inherit).
    *_threads: each service's --torch-threads (0: derived from the CPUs available).
    *_args: extra flags appended to each service's command line (later flags win).
    host / port: where the coordinator listens (target and draft: 127.0.0.1, a free port).
    echo: relay the services' log lines to stderr, prefixed with their names.
    target_replicas / draft_replicas: how many of each behind the one coordinator (it is
    given all their addresses and spreads its sessions over them); `target` and `draft`
    are the first replica of each, `targets` and `drafts` all of them.
    """

    def __init__(
        self,
        target_model: Path | str,
        draft_model: Path | str | None,
        *,
        cache_dir: Path | str | None = None,
        target_threads: int = 1,
        draft_threads: int = 1,
        coordinator_threads: int = 1,
        coordinator_args: Sequence[str] = (),
        target_args: Sequence[str] = (),
        draft_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        ready_timeout_s: float = READY_TIMEOUT_S,
        echo: bool = False,
        target_replicas: int = 1,
        draft_replicas: int = 1,
        spawn: Spawn | None = None,
    ) -> None:
        if target_replicas < 1 or draft_replicas < 1:
            raise ValueError(f"need at least one replica of each (got {target_replicas}, {draft_replicas})")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cache_dir is not None:
            self.env["SPECD_CACHE_DIR"] = str(cache_dir)
        self.ready_timeout_s = ready_timeout_s
        common = ["--host", "127.0.0.1", "--port", "0"]
        self.targets = [
            ServiceProcess(
                _replica_name("target", i, target_replicas),
                ["target", "--model", str(target_model), *common, "--torch-threads", str(target_threads), *target_args],
                echo=echo,
                spawn=spawn,
            )
            for i in range(target_replicas)
        ]
        self.drafts = [
            ServiceProcess(
                _replica_name("draft", i, draft_replicas),
                [
                    "draft",
                    "--model",
                    str(draft_model),
                    "--target-model",
                    str(target_model),
                    *common,
                    "--torch-threads",
                    str(draft_threads),
                    *draft_args,
                ],
                echo=echo,
                spawn=spawn,
            )
            for i in range(draft_replicas if draft_model is not None else 0)
        ]
        self.target = self.targets[0]
        self.draft = self.drafts[0] if self.drafts else None
        for service in self._peers:
            service.ready_timeout_s = ready_timeout_s
        self._tokenizer = str(target_model)
        self._coordinator_threads = coordinator_threads
        self._coordinator_args = list(coordinator_args)
        self._host, self._port = host, port
        self._echo = echo
        self._spawn = spawn
        self.coordinator: ServiceProcess | None = None

    @property
    def _peers(self) -> list[ServiceProcess]:
        return [*self.targets, *self.drafts]

    @property
    def services(self) -> list[ServiceProcess]:
        """The services started so far, in start order."""
        return [s for s in (*self._peers, self.coordinator) if s is not None and s.proc is not None]

    def start(self) -> LocalCluster:
        """Start target and draft together, then the coordinator; ServiceFailed as soon as one exits early."""
        try:
            for service in self._peers:
                service.start(self.env)
            wait_all_ready(self._peers, self.ready_timeout_s)
            self.coordinator = ServiceProcess(
                "coordinator",
                [
                    "coordinator",
                    "--host",
                    self._host,
                    "--port",
                    str(self._port),
                    "--torch-threads",
                    str(self._coordinator_threads),
                    "--target",
                    ",".join(t.address or "" for t in self.targets),
                    "--draft",
                    ",".join(d.address or "" for d in self.drafts) or "none",
                    "--tokenizer",
                    self._tokenizer,
                    *self._coordinator_args,
                ],
                echo=self._echo,
                spawn=self._spawn,
            )
            self.coordinator.ready_timeout_s = self.ready_timeout_s
            self.coordinator.start(self.env)
            self.coordinator.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def address(self) -> str:
        assert self.coordinator is not None and self.coordinator.address
        return self.coordinator.address

    def client(self, timeout: float = 120.0) -> CoordinatorClient:
        return CoordinatorClient(self.address, timeout=timeout)

    def peak_rss_bytes(self) -> dict[str, int | None]:
        """Peak RSS of each running service (and its descendants), by service name."""
        return {s.name: s.peak_rss_bytes() for s in self.services}

    def logs(self, lines: int = 40) -> str:
        out = []
        for s in (*self._peers, self.coordinator):
            if s is not None:
                out.append(f"==== {s.name}\n" + "".join(s.tail(lines)))
        return "\n".join(out)

    def stop(self, grace_s: float = 10.0) -> None:
        for s in (self.coordinator, *self.drafts, *self.targets):  # coordinator first: it drains its requests
            if s is not None:
                s.stop(grace_s=grace_s)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
