"""A fork server for local services: specd imported once, each `specd serve` forked from it.

A fresh `python -m specd.tools.entry serve` spends 3-6 CPU-s importing torch,
transformers and grpc before it serves anything: on a 2-core machine, starting
the three services of `specd up` takes seconds of imports, and so does every
restart of one. The fork server is one process that has imported specd (and
started no thread of its own, no channel, no OpenMP pool, no CUDA context);
each service is a fork of it that runs the very entry point a fresh
interpreter would (`specd.tools.entry.main`) with its own argv, environment,
working directory, session and output pipe. `specd up` (specd.tools.launcher)
starts its services this way, and so do the tests' clusters (tests/cluster.py).

What a fork cannot change is what those libraries read while being imported:
a service whose environment differs from the server's in such a variable
(GRPC_*, OMP_*, GOMP_*, KMP_*, MKL_*, PYTHON*, LD_*, CUDA*, TORCH*) starts as
a fresh interpreter instead (`specd.tools.localcluster.popen_service`), and so
does every service once the server is gone.

The handle a caller gets (`ForkedService`) is the part of subprocess.Popen that
ServiceProcess uses: pid, stdout, poll, wait, send_signal, kill. The server
reaps its children and reports each exit code (negative for a signal, as Popen);
when its client goes away (the launcher killed), it kills the children it has left.

The server process is `python -m specd.tools.fork_template FD` (FD: its end of the socket pair).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

from specd.tools.localcluster import popen_service

log = logging.getLogger(__name__)

_IMPORT_TIME = ("GRPC_", "OMP_", "GOMP_", "KMP_", "MKL_", "PYTHON", "LD_", "CUDA", "TORCH")
_MAX_FDS = 1


class ForkedService:
    """A service forked by the server: the subset of subprocess.Popen that ServiceProcess uses."""

    def __init__(self, server: ForkServer, pid: int, stdout_fd: int) -> None:
        self._server = server
        self.pid = pid
        self.args = ["forked", str(pid)]
        self.stdout = open(stdout_fd, encoding="utf-8", errors="replace", newline=None)  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reaped pid (it may be someone else's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: starts the server process, asks it for forks, hears their exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "specd.tools.fork_template", str(theirs.fileno())],
            env=self._env,
            pass_fds=[theirs.fileno()],
            start_new_session=True,
        )
        theirs.close()
        self._sock = ours
        self._reader = ours.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()  # one fork request at a time (its reply is the next "pid" line)
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._changed = threading.Condition()
        self._replies: list[dict[str, int]] = []
        self._gone = False
        threading.Thread(target=self._listen, daemon=True, name="forkserver-listen").start()

    def _listen(self) -> None:
        for line in self._reader:
            message = json.loads(line)
            with self._changed:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:  # the server is gone: nothing more will come
            self._gone = True
            self._replies.append({"gone": 1})
            self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen[str] | ForkedService:
        """The service `specd ARGV` under env: forked when env allows it and the server runs, else a fresh interpreter."""
        env = dict(os.environ if env is None else env)
        keys = set(env) | set(self._env)
        if self._gone or any(k.startswith(_IMPORT_TIME) and env.get(k) != self._env.get(k) for k in keys):
            return popen_service(argv, env)
        read_fd, write_fd = os.pipe()
        try:
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
            with self._lock:
                try:
                    socket.send_fds(self._sock, [request], [write_fd])
                except OSError:
                    reply = {"gone": 1}
                else:
                    reply = self._reply(timeout_s=30.0)
        finally:
            os.close(write_fd)
        if "pid" not in reply:
            os.close(read_fd)
            if "gone" in reply:  # the server died: a fresh interpreter does the same, only slower
                log.warning("the fork server is gone; starting `specd %s` as a fresh interpreter", argv[:2])
                self._gone = True
                return popen_service(argv, env)
            raise RuntimeError(f"the fork server could not start `specd {' '.join(argv)}`: {reply}")
        self._pids.append(reply["pid"])
        return ForkedService(self, reply["pid"], read_fd)

    def _reply(self, timeout_s: float) -> dict[str, int]:
        with self._changed:
            if not self._changed.wait_for(lambda: bool(self._replies), timeout_s):
                return {"timeout": 1}
            return self._replies.pop(0)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server and any service of its still running (callers stop theirs first)."""
        for pid in self._pids:
            if self.exit_code(pid) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


# ---- the server process ------------------------------------------------------------------------


def _child(request: dict, out_fd: int, sock: socket.socket, run: Callable[[list[str]], int]) -> None:
    """In the fork: become the service (session, output, environment, directory) and run it; never returns."""
    code = 1
    try:
        sock.close()
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.close(devnull)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["specd", *request["argv"]]
        code = run(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's last word: print it, exit 1, never return
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(fd: int, run: Callable[[list[str]], int]) -> None:
    """The server's loop (specd.tools.fork_template runs it): fork `run(argv)` for each request on socket fd.

    The caller has loaded what `run` needs. Returns once the client closed its end and the children
    it left are killed and reaped.
    """
    sock = socket.socket(fileno=fd)
    buffer = b""
    pending: list[int] = []  # fds received with a request line not complete yet
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
            if not data:
                break  # the client closed its end (stopped, or killed)
            buffer += data
            pending += fds
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                out_fd = pending.pop(0)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), out_fd, sock, run)
                os.close(out_fd)
                children.add(pid)
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    for pid in children:  # orphans of a client that is gone: stop them
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        for pid in list(children):
            if os.waitpid(pid, os.WNOHANG)[0]:
                children.discard(pid)
        time.sleep(0.05)
