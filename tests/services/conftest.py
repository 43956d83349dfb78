"""Fixtures of the service tests: the shared tiny cluster and the bench runner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench_run import RunBench, bench_runner
from tests.cluster import Cluster
from tests.devices import service_device_args


@pytest.fixture(scope="session")
def tiny_cluster(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """target + draft + coordinator processes on the tiny pair, shared by the tests that do not break them.

    Tests that need other coordinator flags start their own coordinator on this target and
    draft (Cluster(..., borrow_target=tiny_cluster, borrow_draft=tiny_cluster)). Both serve
    metrics (--metrics-port 0) for the tests that read their counters.
    """

    target, draft = tiny_pair
    # SPECD_TEST_DEVICE: the device-marked service tests run there (tests/devices.py)
    args = ["--metrics-port", "0", *service_device_args()]
    cache = tmp_path_factory.mktemp("cluster-cache")
    with Cluster(target, draft, cache_dir=cache, target_args=args, draft_args=args) as cluster:
        yield cluster


@pytest.fixture
def run_bench(tmp_path: Path) -> RunBench:
    """`specd bench ARGS` in-process with its JSON report in tmp_path (tests/bench_run.py)."""
    return bench_runner(tmp_path)
