"""Wall-clock milliseconds of one step on a device: synchronised before and after.

A CUDA kernel launch returns before the kernel ends; the time of a step is from the moment
the device is idle to the moment its results are ready, host overhead included (specd's
runner does Python work per layer and session, which is part of its cost).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_ms", "synchronize", "timed_ms"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(step: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of `step`, the device idle before and done after."""
    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples), 4)
