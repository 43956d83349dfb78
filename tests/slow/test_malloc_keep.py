"""keep_freed_buffers: a service's step-sized host buffers come from the heap, not from fresh mappings."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a child so the setting never leaks into the test process. It allocates a 4 MiB buffer
# (an [8, 32000] float32 row batch is 1 MiB) and prints how many mapped blocks malloc holds.
_CHILD = """
import ctypes, sys
from specd.serving.host_memory import keep_freed_buffers
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
print(keep_freed_buffers(int(sys.argv[1])))
before = libc.mallinfo2().hblks
buf = libc.malloc(4 << 20)
print(libc.mallinfo2().hblks - before)
"""


def _child(mib: int) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(mib)], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_kept_buffer_comes_from_the_heap_and_the_default_maps_it() -> None:
    assert _child(0) == ("False", 1)  # glibc's default: a 4 MiB buffer is a fresh mapping
    assert _child(32) == ("True", 0)  # kept: from the heap
