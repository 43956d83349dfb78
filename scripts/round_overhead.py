#!/usr/bin/env python
"""Measure the coordinator's per-round overhead on loopback.

Overhead of a round = its wall time at the coordinator minus the draft's and
the target's own compute time (as they report it). Draft and target run as
separate processes; the coordinator runs in this process so that its round
timings can be read directly.

    .venv/bin/python scripts/round_overhead.py [--target DIR --draft DIR] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from coordinator.client import build_request
from coordinator.server import create_server
from specd.core.tiny_models import build_tiny_pair
from specd.serving.config import CoordinatorConfig
from specd.v1 import coordinator_pb2_grpc
from tests.cluster import QuietService


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(target: str, draft: str, requests: int, tokens: int, k: int, target_threads: int) -> None:
    peers = [
        QuietService("target", ["target", "--model", target, "--port", "0", "--torch-threads", str(target_threads)]),
        QuietService(
            "draft", ["draft", "--model", draft, "--target-model", target, "--port", "0", "--torch-threads", "1"]
        ),
    ]
    for p in peers:
        p.start()
    try:
        addresses = [p.wait_ready(300) for p in peers]
        config = CoordinatorConfig(target=addresses[0], draft=addresses[1], tokenizer=target, port=0)
        handle, engine = await create_server(config)
        await handle.server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for i in range(requests):
                await stub.Generate(
                    build_request(
                        f"request {i}: the quick brown fox",
                        max_new_tokens=tokens,
                        temperature=0.0,
                        ignore_eos=True,
                        speculation="fixed",
                        draft_length=k,
                    )
                )
        timings = list(engine.round_records)
        await handle.stop(1.0)
    finally:
        for p in peers:
            p.stop(10)
    overhead = [t.overhead_ms for t in timings]
    wall = [t.wall_ms for t in timings]
    print(f"rounds measured: {len(timings)} (K={k}, {requests} requests x {tokens} tokens)")
    print(f"round wall ms      p50 {percentile(wall, 0.5):.3f}  p99 {percentile(wall, 0.99):.3f}")
    print(f"draft compute ms   p50 {statistics.median(t.draft_ms for t in timings):.3f}")
    print(f"target compute ms  p50 {statistics.median(t.verify_ms for t in timings):.3f}")
    print(f"overhead ms        p50 {percentile(overhead, 0.5):.3f}  p99 {percentile(overhead, 0.99):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="")
    parser.add_argument("--draft", default="")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--target-threads", type=int, default=1, help="torch threads of the target service")
    args = parser.parse_args()
    target, draft = args.target, args.draft
    if not target:
        target, draft = (str(p) for p in build_tiny_pair(Path(tempfile.mkdtemp(prefix="specd-overhead-"))))
    asyncio.run(measure(target, draft, args.requests, args.tokens, args.draft_length, args.target_threads))


if __name__ == "__main__":
    main()
