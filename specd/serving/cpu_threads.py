"""Intra-op threads that follow the CPUs other processes leave free.

A CPU forward pass is a chain of OpenMP parallel regions, and each region
ends at a barrier. Of the two wait policies (measured in
docs/results/verify-cost.md and docs/results/contention.md):

- spinning (OpenMP's own default: a bounded spin, then sleep) keeps a
  multi-token verify close to a decode step, but beside a busy core a
  thread that is not scheduled holds every region's barrier, and a verify
  takes several times as long;
- PASSIVE (sleep at once) keeps the busy case, but every region pays a
  wake-up, and a multi-token verify costs twice a decode step or more.

One thread has no barrier: at one token it was as fast as two on 2 cores,
and a busy core leaves it alone. So the services keep OpenMP's spin and run
each forward pass with as many threads as there are CPUs that no other
process wants right now (at least 1, at most the configured maximum). The
governor samples the runnable threads of other processes before a pass (at
most every `interval_s`), goes down as soon as two samples in a row say so,
and goes up only after `window` samples all allow it.

Used for CPU model services with `--torch-threads 0` (the default); a fixed
`--torch-threads N` runs N threads always, and so does each rank of `--tp`.
Stdlib and torch only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from specd.serving.cpu_budget import cpu_budget, default_torch_threads

__all__ = [
    "ThreadGovernor",
    "attach_thread_governor",
    "describe_threads",
    "openmp_settings",
    "other_runnable_threads",
]

log = logging.getLogger(__name__)

_DOWN_SAMPLES = 2  # consecutive samples that lower the thread count at once


def other_runnable_threads(loadavg: str = "/proc/loadavg", tasks: str = "/proc/self/task") -> int | None:
    """Threads of other processes that are runnable now, on this process's share of the CPUs; None off Linux.

    /proc/loadavg's fourth field is "runnable/total" over the whole machine,
    this process's threads included; those in state R are subtracted. On a
    machine larger than this process's affinity mask the others are scaled
    to its share of the CPUs (they are spread over all of them).
    """
    try:
        with open(loadavg, encoding="ascii") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        own = 0
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat", encoding="ascii") as f:
                    # "pid (comm) S ...": the state follows the last ')', comm may hold spaces.
                    if f.read().rpartition(")")[2].split()[0] == "R":
                        own += 1
            except OSError:  # the thread ended meanwhile
                continue
    except (OSError, ValueError, IndexError):
        return None
    others = max(0, runnable - own)
    online = os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = online
    return others if allowed >= online else round(others * allowed / online)


class ThreadGovernor:
    """Sets torch's intra-op threads before each forward pass from the CPUs others leave free.

    `probe` returns the runnable threads of other processes (None: unknown,
    keep the current count); `set_threads` applies a count (torch's, in the
    thread that runs the passes: OpenMP keeps the count per thread).
    """

    def __init__(
        self,
        max_threads: int,
        cpus: int,
        *,
        probe: Callable[[], int | None] = other_runnable_threads,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 0.05,
        window: int = 5,
    ) -> None:
        if max_threads < 1 or cpus < 1 or window < _DOWN_SAMPLES:
            raise ValueError(f"need max_threads >= 1, cpus >= 1, window >= {_DOWN_SAMPLES}")
        self.max_threads = max_threads
        self.cpus = cpus
        self._probe = probe
        self._set_threads = set_threads
        self._clock = clock
        self._interval_s = interval_s
        self._wants: deque[int] = deque(maxlen=window)
        self._last_sample = -float("inf")
        self._threads = 0  # not applied yet: the first pass applies max_threads or fewer
        self.changes = 0

    @property
    def threads(self) -> int:
        """The count the last pass ran with (0 before the first)."""
        return self._threads

    def before_pass(self) -> int:
        """Sample (at most every interval_s), apply a new count if the samples call for it; the count."""
        now = self._clock()
        if now - self._last_sample >= self._interval_s:
            self._last_sample = now
            others = self._probe()
            if others is not None:
                self._wants.append(max(1, min(self.max_threads, self.cpus - others)))
        target = self._decide()
        if target != self._threads:
            self._set_threads(target)
            self._threads = target
            self.changes += 1
        return target

    def _decide(self) -> int:
        current = self._threads or self.max_threads
        recent = list(self._wants)
        if len(recent) >= _DOWN_SAMPLES and max(recent[-_DOWN_SAMPLES:]) < current:
            return max(recent[-_DOWN_SAMPLES:])
        if len(recent) == self._wants.maxlen and min(recent) > current:
            return min(recent)
        return current

    def attach(self, module: torch.nn.Module) -> Any:
        """Run before_pass ahead of every forward call of `module` (in the thread that runs it); the hook handle."""

        def hook(_module: torch.nn.Module, _args: Any) -> None:  # None: the pass's inputs stay as they are
            self.before_pass()

        return module.register_forward_pre_hook(hook)


def attach_thread_governor(module: torch.nn.Module, torch_threads: int, device: str) -> ThreadGovernor | None:
    """With --torch-threads 0 on CPU, a governor on `module`'s forward passes (up to the CPU budget); else None."""
    if torch_threads or torch.device(device).type != "cpu":
        return None
    budget = cpu_budget()
    governor = ThreadGovernor(default_torch_threads(budget), budget)
    governor.attach(module)
    log.info("threads: up to %d per forward pass, fewer while other processes take CPUs", governor.max_threads)
    return governor


_OPENMP_LIBRARIES = {"libgomp": "GNU libgomp", "libiomp5": "Intel libiomp5", "libomp": "LLVM libomp"}
_OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def openmp_settings(maps: str = "/proc/self/maps") -> dict[str, str]:
    """The OpenMP runtime this process loaded (from its memory maps) and the variables it reads that are set."""
    runtime = "unknown"
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            names = {line.rsplit("/", 1)[-1].strip() for line in f if ".so" in line}
    except OSError:
        names = set()
    for prefix, label in _OPENMP_LIBRARIES.items():
        if any(n.startswith((prefix + ".", prefix + "-")) for n in names):
            runtime = label
            break
    settings = {"openmp": runtime}
    settings.update({k: os.environ[k] for k in _OPENMP_VARIABLES if k in os.environ})
    return settings


def describe_threads(torch_threads: int) -> str:
    """One line for logs and reports: the intra-op threads and the OpenMP runtime's wait settings."""
    omp = openmp_settings()
    waits = ", ".join(f"{k}={v}" for k, v in omp.items() if k != "openmp") or "the runtime's default wait policy"
    return f"{torch_threads} intra-op threads; OpenMP: {omp['openmp']}, {waits}"
