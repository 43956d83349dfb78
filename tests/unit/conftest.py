"""The unit tier: every phase of every test here runs with process starts refused (tests/tiers.py).

Session fixtures a unit test asks for are built inside the guard too, so a test
that needs a cluster fails here instead of quietly starting one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tiers import PROCESS_STARTS, no_process_start


def _guarded(item: pytest.Item) -> Iterator[None]:
    # pytest calls these hooks only for the tests under this folder
    attempts = item.stash.setdefault(PROCESS_STARTS, [])
    with no_process_start(item.nodeid, attempts):
        result = yield
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield from _guarded(item)
    attempts = item.stash.get(PROCESS_STARTS, [])
    if attempts:  # also when the code under test swallowed the ProcessStartRefused
        pytest.fail(f"{item.nodeid} tried to start a process in the unit tier ({', '.join(attempts)})", pytrace=False)
    return result
