"""Thread defaults that hold up when something else takes CPU.

A torch forward pass on CPU is a chain of short OpenMP parallel regions. By
default OpenMP threads spin between regions, so each looks busy to the
kernel; when another process takes a core, a spinning thread time-shares
that core in scheduler slices (milliseconds) while every region waits for it
(microseconds of work): measured ~25x slower (issue #19). With
OMP_WAIT_POLICY=PASSIVE idle threads sleep, a woken thread is scheduled at
once, and a busy neighbour costs about its share of the CPU.

The wait policy is read when torch's OpenMP runtime loads, so it must be in
the environment before `import torch`: the `specd` command sets it first
thing (specd.tools.entry), and the launcher passes it to the services it
starts. Explicit settings in the environment always win.

Stdlib only: imported before torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["cpu_budget", "default_torch_threads", "thread_environment"]

# What the services' environment gets unless the user set it.
_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def thread_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The entries to add to `env` (never overriding what it has): OMP_WAIT_POLICY=PASSIVE."""
    return {k: v for k, v in _ENV_DEFAULTS.items() if k not in env}


def _cgroup_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """CPUs granted by a cgroup v2 quota ("QUOTA PERIOD"; "max" = none), e.g. a container's CPU limit."""
    try:
        with open(cpu_max, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def cpu_budget() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def default_torch_threads(budget: int | None = None, ranks: int = 1) -> int:
    """Intra-op threads of one model process: the CPU budget shared by `ranks` processes, at least 1.

    Each thread must be able to own a core: more threads than cores
    oversubscribe, and every parallel region then waits for the thread that
    is not running.
    """
    budget = cpu_budget() if budget is None else budget
    return max(1, budget // max(1, ranks))
