"""Host buffers reused from the heap instead of mapped fresh on every allocation (glibc's malloc).

glibc serves an allocation above its mmap threshold (128 KiB, raised only
after such a buffer is freed) with a fresh mapping and returns it to the
kernel on free, so the next one is faulted in again, page by page. A service
allocates such buffers on every step: a sampled batch's processed p ([R, V]
float32, 1 MiB at 8 rows of 32,000 tokens), its float64 sum's temporary, q's
candidates. Measured on this machine with the draft's code in one process
(emulated h100-8b, a speculation cache's branch call of 8 rows, T = 0.7;
`scripts/sim_host_cost.py --profile h100-8b --vocab 32000 --rounds 200`, and
again with MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864,
the setting below at 32 MiB): 10.8-11.6 ms with glibc's defaults, 9.1-9.3 ms
with buffers kept.

`keep_freed_buffers(mib)` sets M_MMAP_THRESHOLD to `mib` MiB (larger buffers,
such as a model's weights and KV cache, are still mapped) and M_TRIM_THRESHOLD
to twice that (the free memory the heap may keep at its top). It applies to
the calling process only; worker processes it starts later are not changed.
"""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["keep_freed_buffers"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3


def keep_freed_buffers(mib: int) -> bool:
    """Keep freed host buffers up to `mib` MiB for reuse (glibc only); True if set, False if left as is.

    mib = 0 leaves glibc's defaults. Elsewhere (another C library, another OS) nothing changes.
    """
    if mib <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        log.info("host buffers: no mallopt in this C library; its allocator's defaults apply")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    size = mib << 20
    if not (mallopt(_M_MMAP_THRESHOLD, size) and mallopt(_M_TRIM_THRESHOLD, 2 * size)):
        log.warning("host buffers: mallopt refused a %d MiB threshold; glibc's defaults apply", mib)
        return False
    return True
