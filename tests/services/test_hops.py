"""The round overhead, hop by hop: each call's round trip is split by what the service measured.

A coordinator in this process (so its round records can be read) over the
tiny cluster's draft and target processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from coordinator.client import build_request
from coordinator.server import create_server
from specd.core.rounds.record import RoundRecord
from specd.core.transit import HOPS
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.v1 import coordinator_pb2_grpc
from tests.cluster import Cluster

CLOCK_SLACK_MS = 0.01  # the services report whole microseconds


def run(cluster: Cluster, tokenizer: Path, pipeline: str) -> tuple[list[RoundRecord], CoordinatorMetrics]:
    async def main() -> tuple[list[RoundRecord], CoordinatorMetrics]:
        assert cluster.draft is not None
        config = CoordinatorConfig(
            target=cluster.target.address, draft=cluster.draft.address, tokenizer=str(tokenizer), port=0
        )
        metrics = CoordinatorMetrics()
        handle, engine = await create_server(config, metrics=metrics)
        await handle.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                for speculation in ("fixed", "off"):
                    request = build_request(
                        "hops",
                        max_new_tokens=24,
                        temperature=0.0,
                        ignore_eos=True,
                        speculation=speculation,
                        draft_length=3,
                        pipeline=pipeline,
                    )
                    await stub.Generate(request)
        finally:
            await handle.stop(1.0)
        return list(engine.round_records), metrics

    return asyncio.run(main())


@pytest.mark.parametrize("pipeline", ["off", "bonus-match"])
def test_every_call_names_its_hops_and_they_fit_in_the_overhead(
    tiny_cluster: Cluster, tiny_pair: tuple[Path, Path], pipeline: str
) -> None:
    records, metrics = run(tiny_cluster, tiny_pair[0], pipeline)
    verified = [r for r in records if r.verify_transit is not None]
    assert len(verified) == len(records) > 10  # every round made a verify call over the stream
    proposed = [r for r in records if r.draft_transit is not None]
    assert proposed, "some rounds drafted over the stream"
    for r in records:
        for transit in (r.draft_transit, r.verify_transit):
            if transit is None:
                continue
            assert all(ms >= 0 for _, ms in transit.hops())
            assert transit.wire_ms > 0  # two loopback crossings take time
        if r.pipeline_launched == 0:
            # Sequential calls: their hops are part of the overhead, the loop's own share is the rest.
            hops = r.verify_transit.total_ms + (r.draft_transit.total_ms if r.draft_transit else 0.0)
            assert hops <= r.overhead_ms + CLOCK_SLACK_MS
            assert r.loop_ms is not None and r.loop_ms == pytest.approx(r.overhead_ms - hops, abs=CLOCK_SLACK_MS)
    # The services filled in their timing: queued and reply are hand-offs between threads, never 0 µs all along.
    assert sum(r.verify_transit.queue_ms + r.verify_transit.reply_ms for r in verified) > 0
    samples = {
        (s.labels["peer"], s.labels["hop"]): s.value
        for m in metrics.registry.collect()
        if m.name == "specd:round_hop_seconds"
        for s in m.samples
        if s.name.endswith("_count")
    }
    assert samples[("target", "wire")] == len(verified)
    assert samples[("draft", "wire")] == len(proposed)
    assert samples[("coordinator", "loop")] == len(verified)
    assert {hop for _, hop in samples} == {*HOPS, "loop"}
