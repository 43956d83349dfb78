"""The CPUs a service process may use, and its intra-op threads from them.

Stdlib only: the CLI's argument parsers import it at every start.
"""

from __future__ import annotations

import math
import os

__all__ = ["cpu_budget", "default_torch_threads", "service_threads"]


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


def service_threads(torch_threads: int, ranks: int = 1) -> int:
    """A service's intra-op threads: --torch-threads, or with 0 the CPU budget shared by its ranks."""
    return torch_threads or default_torch_threads(ranks=ranks)
