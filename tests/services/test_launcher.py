"""`specd up` as a user runs it (a real process and its three services, tiny models).

It keeps serving when its draft is killed (target-only, exact), restarts a
killed target, stops everything on SIGTERM, takes its services with it when
it is killed, stops everything on the first exit with --no-restart, and
reports a service that exits at start at once.
Every process is started here and killed by pid; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from coordinator.client import CoordinatorClient

REPO = Path(__file__).resolve().parents[2]
START_S = 300.0  # bound on any wait for a start (the machine may be busy); never a speed assertion
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # token ids of the tiny byte-level tokenizer: "Hello, w"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """One `specd up` process; its output lines collected by a thread."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd.tools.entry", "up", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
        self.lines: list[str] = []
        self.done = False  # its output has ended
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self.done = True
            self._new.notify_all()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, *, after: int = 0, timeout: float = START_S) -> re.Match[str]:
        """The first line from index `after` on that matches `pattern` (regex); fails on timeout or exit."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        with self._new:
            while True:
                for line in self.lines[after:]:
                    if m := regex.search(line):
                        return m
                if self.done:
                    raise AssertionError(f"specd up exited ({self.proc.returncode}) before {pattern!r}:\n{self.text()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n{self.text()}")
                self._new.wait(min(left, 1.0))

    def pid_of(self, name: str, after: int = 0) -> int:
        return int(self.wait_for(rf"specd up: {name} ready on \S+ \(pid (\d+)", after=after).group(1))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive: it has exited and waits for its parent.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def started(tiny_pair: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[Up, int, dict[str, int]]]:
    """`specd up` on the tiny pair, once all three services are ready: (up, port, pids by name)."""
    target, draft = tiny_pair
    port = free_port()
    up = Up(
        "--target", str(target), "--draft", str(draft), "--port", str(port), "--cache-dir", str(tmp_path),
        "--target-threads", "1", "--draft-threads", "1", "--http-port", "0",
    )  # fmt: skip
    pids: dict[str, int] = {}
    try:
        up.wait_for(r"coordinator listening on")
        pids.update({name: up.pid_of(name) for name in ("target", "draft", "coordinator")})
        yield up, port, pids
    finally:
        up.stop()
        for m in re.finditer(r"\(pid (\d+)", up.text()):  # every service it started, restarts included
            pid = int(m.group(1))
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def greedy(port: int, **kwargs: object) -> list[int]:
    with CoordinatorClient(f"127.0.0.1:{port}", timeout=60) as client:
        reply = client.generate(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]
    return list(reply.token_ids)


def test_up_keeps_serving_while_its_draft_and_target_are_restarted(started) -> None:
    up, port, pids = started
    reference = greedy(port, speculation="off")
    assert greedy(port, speculation="fixed", draft_length=4) == reference

    # The OpenAI API is up too, on the line `specd up` promises, with the same tokens.
    http = up.wait_for(r"^openai listening on (127\.0\.0\.1:\d+)$").group(1)
    assert up.text().index("coordinator listening on") < up.text().index("openai listening on")
    with openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "draft_length": 4},
        )  # fmt: skip
    assert reply.choices[0].model_extra["token_ids"] == reference

    # The draft dies: the very next request is served (target-only, exact), and the draft comes back.
    mark = len(up.lines)
    os.kill(pids["draft"], signal.SIGKILL)
    with CoordinatorClient(f"127.0.0.1:{port}", timeout=60) as client:
        reply = client.generate(
            PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True, speculation="fixed", draft_length=4
        )
    assert list(reply.token_ids) == reference, up.text()
    up.wait_for(r"specd up: draft exited with signal SIGKILL; restarting in 1 s", after=mark)
    new_draft = up.pid_of("draft", after=mark)
    assert new_draft != pids["draft"] and alive(pids["target"]) and alive(pids["coordinator"])

    # The target dies: requests fail until it is back on its port, then succeed, exactly.
    mark = len(up.lines)
    killed = time.monotonic()
    os.kill(pids["target"], signal.SIGKILL)
    up.wait_for(r"specd up: target exited with signal SIGKILL; restarting in", after=mark)
    new_target = up.pid_of("target", after=mark)
    deadline = killed + START_S
    while True:
        try:
            got = greedy(port, speculation="fixed", draft_length=4)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
            time.sleep(0.5)
    recovered_s = time.monotonic() - killed
    print(f"requests succeed again {recovered_s:.1f} s after the target was killed")
    assert got == reference
    assert alive(new_target) and alive(new_draft) and alive(pids["coordinator"])

    # SIGTERM stops everything, coordinator first, and `specd up` exits 0.
    assert up.stop() == 0, up.text()
    for pid in (new_target, new_draft, pids["coordinator"]):
        assert not alive(pid), f"pid {pid} still running:\n{up.text()}"
    assert "specd up: stopping" in up.text()


def test_a_killed_up_takes_its_services_with_it(started) -> None:
    """SIGKILL leaves `specd up` no time to stop anything: its fork server kills the services it forked."""
    up, _, pids = started
    up.proc.kill()
    up.proc.wait(10)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name for name, pid in pids.items() if alive(pid)], up.text()


def test_no_restart_stops_everything_on_the_first_exit(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = tiny_pair
    up = Up(
        "--target", str(target), "--draft", str(draft), "--port", str(free_port()), "--cache-dir", str(tmp_path),
        "--target-threads", "1", "--no-restart", "--http-port", "0",
    )  # fmt: skip
    try:
        up.wait_for(r"coordinator listening on")
        pids = {name: up.pid_of(name) for name in ("target", "draft", "coordinator")}
        os.kill(pids["draft"], signal.SIGKILL)
        assert up.proc.wait(START_S) == 1, up.text()
        assert "specd up: draft exited with signal SIGKILL; stopping the rest (--no-restart)" in up.text()
        assert not alive(pids["target"]) and not alive(pids["coordinator"])
    finally:
        up.stop()


def test_a_service_that_exits_at_start_is_reported_at_once(tmp_path: Path) -> None:
    """Exit code and last lines, long before the ready timeout (600 s), and no restart loop."""
    missing = tmp_path / "no-such-model"
    up = Up("--target", str(missing), "--draft", "none", "--port", str(free_port()), "--cache-dir", str(tmp_path))
    try:
        assert up.proc.wait(START_S) == 1, up.text()
    finally:
        up.stop()
    text = up.text()
    assert "specd up: target service exited with code 2 before it was ready; its last lines:" in text, text
    assert f"model folder '{missing}' does not exist" in text
    assert "restarting" not in text and "not ready after" not in text


def test_up_starts_replicas_behind_one_coordinator(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """--target-replicas 2 --draft-replicas 2: each replica its own process, all given to the coordinator."""
    target, draft = tiny_pair
    port = free_port()
    up = Up(
        "--target", str(target), "--draft", str(draft), "--port", str(port), "--cache-dir", str(tmp_path),
        "--target-threads", "1", "--draft-threads", "1", "--target-replicas", "2", "--draft-replicas", "2",
        "--http-port", "-1",
    )  # fmt: skip
    try:
        up.wait_for(rf"^coordinator listening on 127\.0\.0\.1:{port}$")
        text = up.text()
        for role in ("target", "draft"):
            listening = set(re.findall(rf"\[{role}-\d\] specd-{role} listening on (\S+)", text))
            assert len(listening) == 2, text
            # the coordinator was given both (it logs each replica it adds)
            added = set(re.findall(rf"{role} replica (\S+) added", text))
            assert added == listening, text
        pids = [up.pid_of(name) for name in ("target-1", "target-2", "draft-1", "draft-2", "coordinator")]
        assert len(set(pids)) == 5
        assert greedy(port, speculation="fixed", draft_length=4) == greedy(port, speculation="off")
        assert up.stop() == 0, up.text()
        assert not any(alive(pid) for pid in pids)
    finally:
        up.stop()
        for m in re.finditer(r"\(pid (\d+)", up.text()):
            if alive(int(m.group(1))):
                os.kill(int(m.group(1)), signal.SIGKILL)
