"""target + draft + coordinator as local `specd serve` processes, started and stopped together.

Used by `specd bench` (which starts its own services) and by the tests
(tests/cluster.py). Unlike `specd up`, the services' log lines are kept in
memory (`QuietService.lines`) instead of being relayed, and can be shown
when something fails.

    with LocalCluster(target_dir, draft_dir, target_threads=2) as cluster:
        with cluster.client() as client:
            print(client.generate("Hello", max_new_tokens=8).text)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from specd.tools.launcher import ServiceProcess

READY_TIMEOUT_S = 120.0


class QuietService(ServiceProcess):
    """A ServiceProcess whose log goes to a list (and to stderr when echo is set)."""

    def __init__(self, name: str, args: list[str], *, echo: bool = False) -> None:
        super().__init__(name, args)
        self.lines: list[str] = []
        self.echo = echo
        self.ready_timeout_s = READY_TIMEOUT_S

    def _on_line(self, line: str) -> None:
        self.lines.append(line)
        if self.echo:
            super()._on_line(line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def restart(self, env: dict[str, str], args: list[str] | None = None) -> str:
        """Start again (after a kill) on the same port, so peers reconnect to it."""
        if args is not None:
            self.args = args
        port = self.address.rsplit(":", 1)[1] if self.address else "0"
        self.args = _with_port(self.args, port)
        self.address = None
        self._ready = threading.Event()
        self.start(env)
        return self.wait_ready(self.ready_timeout_s)

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


def _with_port(args: list[str], port: str) -> list[str]:
    out = list(args)
    out[out.index("--port") + 1] = port
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


class LocalCluster:
    """target + optional draft + coordinator, each its own `specd serve` process on 127.0.0.1.

    target_model / draft_model: what the services' --model takes (a folder, 'demo';
    the draft also 'ngram'); draft_model None runs without a draft.
    cache_dir: exported as SPECD_CACHE_DIR to the services (None: inherit).
    *_threads: each service's --torch-threads (0: torch's default).
    *_args: extra flags appended to each service's command line (later flags win).
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
        ready_timeout_s: float = READY_TIMEOUT_S,
        echo: bool = False,
    ) -> None:
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cache_dir is not None:
            self.env["SPECD_CACHE_DIR"] = str(cache_dir)
        self.ready_timeout_s = ready_timeout_s
        common = ["--host", "127.0.0.1", "--port", "0"]
        self.target = QuietService(
            "target",
            ["target", "--model", str(target_model), *common, "--torch-threads", str(target_threads), *target_args],
            echo=echo,
        )
        self.draft = (
            QuietService(
                "draft",
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
            )
            if draft_model is not None
            else None
        )
        for service in self._peers:
            service.ready_timeout_s = ready_timeout_s
        self._tokenizer = str(target_model)
        self._coordinator_threads = coordinator_threads
        self._coordinator_args = list(coordinator_args)
        self._echo = echo
        self.coordinator: QuietService | None = None

    @property
    def _peers(self) -> list[QuietService]:
        return [self.target] + ([self.draft] if self.draft else [])

    @property
    def services(self) -> list[QuietService]:
        """The services started so far, in start order."""
        return [s for s in (self.target, self.draft, self.coordinator) if s is not None and s.proc is not None]

    def start(self) -> LocalCluster:
        try:
            for service in self._peers:
                service.start(self.env)
            for service in self._peers:
                service.wait_ready(self.ready_timeout_s)
            self.coordinator = QuietService(
                "coordinator",
                [
                    "coordinator",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--torch-threads",
                    str(self._coordinator_threads),
                    "--target",
                    self.target.address or "",
                    "--draft",
                    self.draft.address if self.draft else "none",
                    "--tokenizer",
                    self._tokenizer,
                    *self._coordinator_args,
                ],
                echo=self._echo,
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

    def client(self, timeout: float = 120.0):
        from coordinator.client import CoordinatorClient

        return CoordinatorClient(self.address, timeout=timeout)

    def peak_rss_bytes(self) -> dict[str, int | None]:
        """Peak RSS of each running service (and its descendants), by service name."""
        return {s.name: s.peak_rss_bytes() for s in self.services}

    def logs(self, lines: int = 40) -> str:
        out = []
        for s in (self.target, self.draft, self.coordinator):
            if s is not None:
                out.append(f"==== {s.name}\n" + "".join(s.lines[-lines:]))
        return "\n".join(out)

    def stop(self, grace_s: float = 10.0) -> None:
        for s in (self.coordinator, self.draft, self.target):  # coordinator first: it drains its requests
            if s is not None:
                s.stop(grace_s=grace_s)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
