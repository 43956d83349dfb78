"""scripts/torch_choice.py: which torch build setup installs, and the line that says why.

Real probes against local HTTP servers (one that answers, one that never does), and the
interpreter running the tests; only the GPU detection is overridden (SPECD_GPU), since
CI has no GPU to find.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.torch_choice import decide, gpu_present, installed_torch, reachable

VERSION = "2.13.0"


class _Index(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path.startswith("/whl/cpu/torch/") else 404)
        self.end_headers()
        self.wfile.write(b"<html></html>")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def cpu_index() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_index() -> Iterator[str]:
    """Accepts connections and never answers: what a firewalled index looks like."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/whl/cpu"
    sock.close()


def test_an_installed_torch_is_kept() -> None:
    assert installed_torch(sys.executable)  # the tests' own interpreter has torch
    choice = decide(sys.executable, VERSION, "http://127.0.0.1:9/whl/cpu", "no", 2.0, fresh=False)
    assert choice.pip_args == []
    assert choice.line.startswith("setup: torch: keeping the installed torch ")


def test_a_gpu_gets_the_configured_default_build() -> None:
    assert gpu_present("yes") == (True, "SPECD_GPU=yes")
    choice = decide(sys.executable, VERSION, "http://127.0.0.1:9/whl/cpu", "yes", 2.0, fresh=True)
    assert choice.pip_args == [f"torch=={VERSION}"]
    assert "GPU found (SPECD_GPU=yes)" in choice.line and "CUDA build" in choice.line


def test_no_gpu_and_a_reachable_cpu_index_gets_the_cpu_build_from_it(cpu_index: str) -> None:
    choice = decide(sys.executable, VERSION, cpu_index, "no", 2.0, fresh=True)
    assert choice.pip_args == ["--index-url", cpu_index, f"torch=={VERSION}"]
    assert "no GPU (SPECD_GPU=no)" in choice.line and "CPU build" in choice.line and cpu_index in choice.line


def test_an_index_that_never_answers_is_given_up_on_within_the_timeout(silent_index: str) -> None:
    t0 = time.monotonic()
    ok, why = reachable(f"{silent_index}/torch/", 1.5)
    assert not ok and "1.5 s" in why
    assert time.monotonic() - t0 < 3.0


def test_no_gpu_and_an_unreachable_cpu_index_falls_back_to_the_configured_index(silent_index: str) -> None:
    """What the configured index has depends on the machine (here a +cpu wheel, PyPI the CUDA one):
    the line names the build it found, the arguments install exactly that version."""
    choice = decide(sys.executable, VERSION, silent_index, "no", 1.0, fresh=True)
    assert "is unreachable (no answer in 1 s" in choice.line
    assert len(choice.pip_args) == 1 and choice.pip_args[0].startswith(f"torch=={VERSION}")
    if "+cpu" in choice.pip_args[0]:
        assert "the CPU build the configured index has" in choice.line
    elif "could not be asked" not in choice.line:
        assert "only the CUDA build" in choice.line and "+cpu wheel in pip's find-links" in choice.line
