"""Each test process's fork server (specd.tools.forkserver): its services are forks of one that imported specd.

A test run starts about a hundred services on two cores; a fresh interpreter each would spend
3-6 CPU-s on imports before serving anything, the largest single cost of the suite.
"""

from __future__ import annotations

import atexit
import functools

from specd.tools.forkserver import ForkServer


@functools.cache
def shared_fork_server() -> ForkServer:
    """This test process's fork server, started on first use and stopped at exit."""
    server = ForkServer()
    atexit.register(server.close)
    return server
