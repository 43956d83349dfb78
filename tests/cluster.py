"""Test harness: the three services as separate `specd serve` processes on 127.0.0.1.

Every process is started and stopped by the tests, with bounded waits.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc

from coordinator.client import CoordinatorClient
from specd.launcher import _BANNER, ServiceProcess

READY_TIMEOUT_S = 120.0


class QuietService(ServiceProcess):
    """A ServiceProcess whose log goes to a list instead of stderr (shown on failure)."""

    def __init__(self, name: str, args: list[str]) -> None:
        super().__init__(name, args)
        self.lines: list[str] = []

    def _relay(self) -> None:  # type: ignore[override]
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _BANNER.match(line)
            if match and self.address is None:
                self.address = f"{match.group(2)}:{match.group(3)}"
                self._ready.set()
            self.lines.append(line)
        self._ready.set()

    def restart(self, env: dict[str, str], args: list[str] | None = None) -> str:
        """Start again (after a kill) on the same port, so peers reconnect to it."""
        if args is not None:
            self.args = args
        port = self.address.rsplit(":", 1)[1] if self.address else "0"
        self.args = _with_port(self.args, port)
        self.address = None
        self._ready = threading.Event()
        self.start(env)
        return self.wait_ready(READY_TIMEOUT_S)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)


def _with_port(args: list[str], port: str) -> list[str]:
    out = list(args)
    out[out.index("--port") + 1] = port
    return out


class Cluster:
    """target + optional draft + coordinator, each its own process."""

    def __init__(self, target_model: Path | str, draft_model: Path | str | None, *, cache_dir: Path,
                 coordinator_args: list[str] | None = None, target_args: list[str] | None = None,
                 draft_args: list[str] | None = None) -> None:
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", SPECD_CACHE_DIR=str(cache_dir))
        common = ["--host", "127.0.0.1", "--port", "0", "--torch-threads", "1"]
        self.target = QuietService("target", ["target", "--model", str(target_model), *common, *(target_args or [])])
        self.draft = (
            QuietService(
                "draft",
                ["draft", "--model", str(draft_model), "--target-model", str(target_model), *common, *(draft_args or [])],
            )
            if draft_model is not None
            else None
        )
        self._tokenizer = str(target_model)
        self._coordinator_args = coordinator_args or []
        self.coordinator: QuietService | None = None

    def start(self) -> "Cluster":
        peers = [self.target] + ([self.draft] if self.draft else [])
        for service in peers:
            service.start(self.env)
        for service in peers:
            service.wait_ready(READY_TIMEOUT_S)
        self.coordinator = QuietService(
            "coordinator",
            [
                "coordinator", "--host", "127.0.0.1", "--port", "0",
                "--target", self.target.address or "",
                "--draft", self.draft.address if self.draft else "none",
                "--tokenizer", self._tokenizer,
                "--draft-retry-s", "0.5",
                "--draft-timeout-s", "3",
                *self._coordinator_args,
            ],
        )
        self.coordinator.start(self.env)
        self.coordinator.wait_ready(READY_TIMEOUT_S)
        return self

    @property
    def address(self) -> str:
        assert self.coordinator is not None and self.coordinator.address
        return self.coordinator.address

    def client(self, timeout: float = 120.0) -> CoordinatorClient:
        return CoordinatorClient(self.address, timeout=timeout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def logs(self) -> str:
        out = []
        for s in (self.target, self.draft, self.coordinator):
            if s is not None:
                out.append(f"==== {s.name}\n" + "".join(s.lines[-40:]))
        return "\n".join(out)

    def stop(self) -> None:
        for s in (self.coordinator, self.draft, self.target):
            if s is not None:
                s.stop(grace_s=10.0)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
