"""specd.tools.forkserver: a forked service is the service a fresh interpreter would run, and a
service still starts (as a fresh interpreter) when the server is gone or its environment differs."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from specd.tools.forkserver import ForkedService, ForkServer
from specd.tools.localcluster import ServiceHandle


@pytest.fixture
def server() -> Iterator[ForkServer]:
    forks = ForkServer()
    yield forks
    forks.close()


def _help(handle: ServiceHandle) -> tuple[str, int]:
    """Its whole output and its exit code."""
    assert handle.stdout is not None
    text = handle.stdout.read()
    return text, handle.wait(60)


def test_a_fork_runs_the_entry_point_with_its_own_arguments_and_exit_code(server: ForkServer) -> None:
    forked = server.spawn(["serve", "--help"], None)
    assert isinstance(forked, ForkedService)
    text, code = _help(forked)
    assert code == 0 and "usage: specd serve" in text
    failed = server.spawn(["serve", "no-such-service"], None)
    assert isinstance(failed, ForkedService)
    text, code = _help(failed)
    assert code == 2 and "invalid choice" in text


def test_an_import_time_variable_or_a_dead_server_means_a_fresh_interpreter(server: ForkServer) -> None:
    fresh = server.spawn(["serve", "--help"], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert isinstance(fresh, subprocess.Popen)
    assert _help(fresh)[1] == 0
    server._proc.kill()  # the server dies: later services still start
    server._proc.wait(10)
    later = server.spawn(["serve", "--help"], None)
    assert isinstance(later, subprocess.Popen)
    text, code = _help(later)
    assert code == 0 and "usage: specd serve" in text
