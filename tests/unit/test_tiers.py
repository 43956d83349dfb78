"""The tiers' own rules: a unit test that starts a process fails, and every test has its folder's marker."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import PROCESS_STARTS, TESTS, ProcessStartRefused, mark_by_tier, tier_of


def test_every_way_to_start_a_process_is_refused_and_noted(request: pytest.FixtureRequest) -> None:
    starts = [
        lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        lambda: subprocess.Popen(["true"]),
        lambda: subprocess.check_output(["true"]),
        lambda: os.system("true"),
        lambda: os.posix_spawn("/bin/true", ["true"], {}),
        lambda: os.fork() if os.fork.__name__ == "refuse" else pytest.fail("os.fork is not guarded"),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    ]
    for start in starts:
        with pytest.raises(ProcessStartRefused, match="the unit tier starts none"):
            start()
    noted = request.node.stash[PROCESS_STARTS]
    assert len(noted) == len(starts), noted
    noted.clear()  # they were refused on purpose: this test passes


def test_a_swallowed_refusal_still_fails_the_test(pytester: pytest.Pytester) -> None:
    """The guard in a fresh session (in this process): code that catches the refusal does not hide it."""
    unit = pytester.mkdir("unit")
    (unit / "conftest.py").write_text((TESTS / "unit" / "conftest.py").read_text())
    (unit / "test_sneaky.py").write_text(
        "import subprocess\n"
        "def test_sneaky():\n"
        "    try:\n"
        "        subprocess.run(['true'])\n"
        "    except Exception:\n"
        "        pass\n"
    )
    result = pytester.runpytest_inprocess(str(unit / "test_sneaky.py"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*tried to start a process in the unit tier*"])


def test_each_test_file_has_the_tier_of_its_folder() -> None:
    assert tier_of(TESTS / "unit" / "core" / "test_loop.py") == "unit"
    assert tier_of(TESTS / "services" / "test_faults.py") == "services"
    assert tier_of(TESTS / "test_somewhere.py") is None  # beside the tiers, in none
    assert tier_of(TESTS / "elsewhere" / "test_x.py") is None
    assert tier_of(Path("/tmp/test_x.py")) is None


def test_a_test_outside_the_tiers_is_a_usage_error(request: pytest.FixtureRequest) -> None:
    class Item:  # what mark_by_tier reads of a collected test
        def __init__(self, path: Path) -> None:
            self.path, self.nodeid, self.markers = path, path.name, []

        def add_marker(self, name: str) -> None:
            self.markers.append(name)

    inside, outside = Item(TESTS / "unit" / "test_a.py"), Item(TESTS / "test_b.py")
    mark_by_tier([inside])
    assert inside.markers == ["unit"]
    with pytest.raises(pytest.UsageError, match=r"test_b\.py"):
        mark_by_tier([outside])
    assert "unit" in {m.name for m in request.node.iter_markers()}
