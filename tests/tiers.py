"""The test tiers, by weight: each folder under tests/ is one, and its name is its pytest marker.

    unit/      in-process, no process start (a guard refuses one); mirrors the source tree
    slow/      in-process but long: statistical tests and the demo model
    services/  real `specd serve` processes (and other programs) on 127.0.0.1
    deploy/    the Helm chart, the manifests and the image

`scripts/test.sh --unit` runs the unit tier alone; `pytest -m "not services"` and the like
pick tiers by marker.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "slow", "services", "deploy")


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under tests/ it lies in (None: in none)."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def mark_by_tier(items: list[pytest.Item]) -> None:
    """Give every collected test its tier's marker; a test outside every tier is a usage error."""
    outside = []
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            outside.append(item.nodeid)
        else:
            item.add_marker(tier)
    if outside:
        raise pytest.UsageError(
            f"tests outside the tiers {', '.join(TIERS)} (move them into tests/<tier>/): " + ", ".join(outside)
        )


PROCESS_STARTS = pytest.StashKey[list[str]]()  # on a unit test's item: the process starts it tried


class ProcessStartRefused(RuntimeError):
    """A unit test tried to start a process; real processes belong in tests/services."""


# (module, attribute) of every way Python starts a process: subprocess (however it is imported,
# Popen ends in _execute_child), multiprocessing (fork, spawn, forkserver) and the os functions.
_STARTERS = [
    (subprocess.Popen, "_execute_child"),
    (_posixsubprocess, "fork_exec"),
    (multiprocessing.process.BaseProcess, "start"),
    *[
        (os, name)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnv", "spawnve")
        if hasattr(os, name)
    ],
]


@contextmanager
def no_process_start(nodeid: str, attempts: list[str]) -> Iterator[None]:
    """Make every process start raise ProcessStartRefused, and note it in `attempts`.

    The note is kept even when the code under test catches the exception, so the
    test still fails (scripts/test.sh --unit promises a tier that starts nothing).
    """

    def refusing(what: str) -> Callable[..., object]:
        def refuse(*args: object, **kwargs: object) -> object:
            attempts.append(what)
            raise ProcessStartRefused(
                f"{nodeid} starts a process ({what}): the unit tier starts none; move it to tests/services"
            )

        return refuse

    patch = pytest.MonkeyPatch()
    for owner, name in _STARTERS:
        patch.setattr(owner, name, refusing(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        patch.undo()
