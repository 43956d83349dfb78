"""scripts/round_overhead.py's --coordinator-extra-us probe: a spin before each peer request, undone after."""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import pytest

from coordinator.peers import PeerStream
from tests.script_modules import load_script


@pytest.fixture
def overhead(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_script("round_overhead", monkeypatch)


def test_extra_request_cpu_spins_before_each_request_and_restores_it(
    overhead: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, Any, float]] = []

    def request(self: Any, msg: Any, timeout: float) -> str:
        calls.append((self, msg, timeout))
        return "sent"

    monkeypatch.setattr(PeerStream, "request", request)
    with overhead.extra_request_cpu(3000.0):
        start = time.perf_counter()
        assert PeerStream.request("stream", "msg", 1.5) == "sent"  # type: ignore[arg-type]
        assert time.perf_counter() - start >= 3e-3
    assert calls == [("stream", "msg", 1.5)]
    assert PeerStream.request is request  # undone when the block ends
    with overhead.extra_request_cpu(0.0):
        assert PeerStream.request is request  # 0: nothing replaced


def test_the_flag_reaches_the_arguments(overhead: ModuleType) -> None:
    assert overhead.parse_arguments([]).coordinator_extra_us == 0.0
    assert overhead.parse_arguments(["--coordinator-extra-us", "100"]).coordinator_extra_us == 100.0


def test_every_request_of_a_fixed_mode_stream_has_its_own_seed(overhead: ModuleType) -> None:
    """With one seed per stream, a stream's requests drew the same coins at the same positions and
    (the emulated model reading only its last few tokens) converged to one text: a fixed mode at
    T > 0 measured one short sample's acceptance over and over."""
    sent: list[Any] = []

    class Stub:
        async def Generate(self, request: Any) -> None:
            sent.append(request)

    asyncio.run(overhead.run_streams(Stub(), 2, 48, 3, 0.7, request_tokens=16))  # type: ignore[arg-type]
    assert len(sent) == 6
    seeds = [r.sampling.seed for r in sent]
    assert len(set(seeds)) == 6
    sent.clear()
    asyncio.run(overhead.run_streams(Stub(), 1, 32, 3, 0.7, speculation="auto", request_tokens=16))  # type: ignore[arg-type]
    assert [r.sampling.HasField("seed") for r in sent] == [False, False]  # auto's: drawn by the coordinator
