"""The thread governor: fewer intra-op threads while other processes take CPUs, back when they are gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specd.serving.cpu_budget import default_torch_threads
from specd.serving.cpu_threads import ThreadGovernor, attach_thread_governor, other_runnable_threads


class Machine:
    """A fake clock and /proc: `others` runnable threads of other processes, time advanced per pass."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others: int | None = 0
        self.probes = 0
        self.applied: list[int] = []

    def probe(self) -> int | None:
        self.probes += 1
        return self.others

    def governor(self, max_threads: int = 2, cpus: int = 2, window: int = 5) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            cpus,
            probe=self.probe,
            set_threads=self.applied.append,
            clock=lambda: self.now,
            interval_s=0.05,
            window=window,
        )

    def passes(self, governor: ThreadGovernor, n: int, *, dt: float = 0.06) -> list[int]:
        counts = []
        for _ in range(n):
            counts.append(governor.before_pass())
            self.now += dt
        return counts


def test_starts_at_the_maximum_and_stays_there_when_quiet() -> None:
    m = Machine()
    g = m.governor()
    assert m.passes(g, 20) == [2] * 20
    assert m.applied == [2]  # applied once, on the first pass


def test_goes_down_after_two_busy_samples_and_up_after_a_quiet_window() -> None:
    m = Machine()
    g = m.governor(window=5)
    m.passes(g, 3)
    m.others = 1  # a busy loop appears
    assert m.passes(g, 3) == [2, 1, 1]  # one sample could be a passing burst; two in a row are not
    m.others = 0
    # Up only once all 5 samples of the window allow it: the first 4 quiet samples still hold busy ones.
    assert m.passes(g, 6) == [1, 1, 1, 1, 2, 2]
    assert m.applied == [2, 1, 2]
    assert g.changes == 3


def test_one_busy_sample_is_not_enough() -> None:
    m = Machine()
    g = m.governor()
    m.passes(g, 3)
    m.others = 1
    m.passes(g, 1)
    m.others = 0
    assert m.passes(g, 5) == [2] * 5
    assert m.applied == [2]


def test_uses_the_cpus_left_free_on_a_larger_machine() -> None:
    m = Machine()
    g = m.governor(max_threads=8, cpus=8)
    m.passes(g, 2)
    m.others = 3
    assert m.passes(g, 3)[-1] == 5
    m.others = 20  # never fewer than one thread
    assert m.passes(g, 3)[-1] == 1


def test_samples_at_most_once_per_interval() -> None:
    m = Machine()
    g = m.governor()
    m.passes(g, 10, dt=0.01)  # 10 passes in 0.1 s
    assert m.probes == 2


def test_an_unknown_reading_keeps_the_count() -> None:
    m = Machine()
    g = m.governor()
    m.passes(g, 2)
    m.others = 1
    m.passes(g, 3)
    m.others = None  # off Linux, or /proc unreadable
    assert m.passes(g, 10) == [1] * 10


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(0, 2)
    with pytest.raises(ValueError):
        ThreadGovernor(2, 2, window=1)


def _fake_proc(tmp_path: Path, loadavg: str, states: list[str]) -> tuple[str, str]:
    (tmp_path / "loadavg").write_text(loadavg)
    tasks = tmp_path / "task"
    for i, state in enumerate(states):
        (tasks / str(100 + i)).mkdir(parents=True)
        # A comm with spaces and a ')' of its own: the state is the field after the last ')'.
        (tasks / str(100 + i) / "stat").write_text(f"{100 + i} (py thr) x) {state} 1 2 3\n")
    return str(tmp_path / "loadavg"), str(tasks)


def test_other_runnable_threads_subtracts_this_process(tmp_path: Path) -> None:
    loadavg, tasks = _fake_proc(tmp_path, "0.50 0.40 0.30 4/321 9999\n", ["R", "S", "R", "S"])
    # 4 runnable on the machine, 2 of them ours; the others are scaled to this process's share of the CPUs.
    online, allowed = os.cpu_count() or 1, len(os.sched_getaffinity(0))
    assert other_runnable_threads(loadavg, tasks) == (2 if allowed >= online else round(2 * allowed / online))


def test_other_runnable_threads_unreadable_is_none(tmp_path: Path) -> None:
    assert other_runnable_threads(str(tmp_path / "missing"), str(tmp_path)) is None
    (tmp_path / "loadavg").write_text("garbage\n")
    assert other_runnable_threads(str(tmp_path / "loadavg"), str(tmp_path)) is None


def test_the_hook_runs_before_each_forward_and_leaves_inputs_alone() -> None:
    m = Machine()
    g = m.governor()
    module = torch.nn.Linear(3, 2)
    g.attach(module)
    x = torch.ones(1, 3)
    assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias))
    module(x)
    assert m.probes == 1 and g.threads == 2  # two passes, one sample (same instant)


def test_governed_only_on_cpu_with_torch_threads_zero() -> None:
    module = torch.nn.Linear(3, 2)
    assert attach_thread_governor(module, 2, "cpu") is None  # a fixed --torch-threads
    assert attach_thread_governor(module, 0, "cuda") is None
    governor = attach_thread_governor(module, 0, "cpu")
    assert governor is not None
    assert governor.max_threads == default_torch_threads()
    previous = torch.get_num_threads()
    try:
        module(torch.ones(1, 3))
        assert torch.get_num_threads() == governor.threads
    finally:
        torch.set_num_threads(previous)
