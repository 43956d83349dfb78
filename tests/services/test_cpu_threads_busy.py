"""The thread governor's probe on the real /proc: another process's busy loop is counted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specd.serving.cpu_threads import other_runnable_threads


def test_a_busy_process_is_seen() -> None:
    """On the real /proc: a busy loop beside this process is counted among the others."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        readings = []
        for _ in range(20):
            readings.append(other_runnable_threads())
            time.sleep(0.01)
    finally:
        busy.kill()
        busy.wait(timeout=10)
    if readings[0] is None:
        pytest.skip("no /proc/loadavg here")
    assert max(r or 0 for r in readings) >= 1
