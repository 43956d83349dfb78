#!/usr/bin/env python
"""The floor of a round's overhead on this machine: specd's round shape with nothing of specd in it.

`../shared/tools/grpc_floor.py` times back-to-back messages on a hot stream. A round is not
that: each process waits idle while another one computes, so every message lands on a process
whose threads sleep (the gRPC poller thread, then the event loop thread, then the model
thread). This script runs the round's shape with raw bytes and no specd code: a client (the
coordinator) sends one message to service A (the draft), whose model thread "computes" for
--draft-ms, then one to service B (the target) for --verify-ms; the overhead of a round is its
wall time minus the two computes. Each service hands each message to its model thread once
and gets the answer back once (the least a service with a model thread can do).

    .venv/bin/python scripts/round_floor.py                   # the h100-tp2-70b round at K=4: 21.4 + 18.6 ms
    .venv/bin/python scripts/round_floor.py --draft-ms 0 --verify-ms 0   # hot: back to back

What it reports is the floor specd's `scripts/round_overhead.py` can be compared with; the
modelled compute is a sleep, as in the emulator (sim:), so the processes idle as they do there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import grpc

try:
    import uvloop
except ImportError:  # asyncio's own loop then
    uvloop = None  # type: ignore[assignment]


def _ident(x: bytes) -> bytes:
    return x


def _run(main: Any) -> Any:
    return uvloop.run(main) if uvloop is not None else asyncio.run(main)


async def _serve(port_q: Any, compute_ms: float, switch_ms: float, inline: bool) -> None:
    sys.setswitchinterval(switch_ms / 1e3)
    loop = asyncio.get_running_loop()
    work: SimpleQueue[tuple[asyncio.Queue[bytes | None], bytes]] = SimpleQueue()

    def model_thread() -> None:  # one hand-off in, one back (call_soon_threadsafe)
        while True:
            out, msg = work.get()
            if compute_ms:
                time.sleep(compute_ms / 1e3)
            loop.call_soon_threadsafe(out.put_nowait, msg)

    threading.Thread(target=model_thread, daemon=True).start()

    async def inline_rounds(requests: Any, context: Any) -> Any:  # the step on the event loop thread
        async for msg in requests:
            if compute_ms:
                time.sleep(compute_ms / 1e3)
            yield msg

    async def rounds(requests: Any, context: Any) -> Any:
        out: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def read() -> None:
            async for msg in requests:
                work.put((out, msg))
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        while (msg := await out.get()) is not None:
            yield msg
        await reader

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(inline_rounds if inline else rounds, _ident, _ident)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Round", {"Rounds": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    await server.wait_for_termination()


def _service(port_q: Any, compute_ms: float, switch_ms: float, inline: bool) -> None:
    _run(_serve(port_q, compute_ms, switch_ms, inline))


async def _rounds(ports: list[int], n: int, size: int, draft_ms: float, verify_ms: float) -> list[float]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    calls = [
        c.stream_stream("/floor.Round/Rounds", request_serializer=_ident, response_deserializer=_ident)()
        for c in channels
    ]
    payload = b"x" * size
    overhead = []
    for _ in range(n):
        t0 = time.perf_counter()
        for call in calls:  # draft, then target: one message each way to each
            await call.write(payload)
            await call.read()
        overhead.append((time.perf_counter() - t0) * 1e3 - draft_ms - verify_ms)
    for call in calls:
        await call.done_writing()
    for c in channels:
        await c.close()
    return overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-ms", type=float, default=21.4, help="service A's compute per message")
    parser.add_argument("--verify-ms", type=float, default=18.6, help="service B's compute per message")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--size", type=int, default=256, help="message bytes")
    parser.add_argument("--gil-switch-ms", type=float, default=1.0, help="as specd's services (--gil-switch-ms)")
    parser.add_argument("--inline", action="store_true", help="compute on the event loop thread (no hand-off)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    procs, ports = [], []
    for ms in (args.draft_ms, args.verify_ms):
        q = ctx.Queue()
        p = ctx.Process(target=_service, args=(q, ms, args.gil_switch_ms, args.inline), daemon=True)
        p.start()
        procs.append(p)
        ports.append(q.get(timeout=60))
    try:
        sys.setswitchinterval(args.gil_switch_ms / 1e3)
        _run(_rounds(ports, 20, args.size, args.draft_ms, args.verify_ms))  # warm-up
        cpu0 = time.thread_time()
        ms = sorted(_run(_rounds(ports, args.rounds, args.size, args.draft_ms, args.verify_ms)))
        cpu_ms = (time.thread_time() - cpu0) / args.rounds * 1e3
    finally:
        for p in procs:
            p.terminate()
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    print(
        f"round floor (raw bytes, {args.size} B, "
        f"{'compute on the event loop' if args.inline else 'one model-thread hand-off each way per service'}), "
        f"compute {args.draft_ms} + {args.verify_ms} ms: overhead p50 {p50:.3f} ms, p99 {p99:.3f} ms; "
        f"the client's event-loop CPU {cpu_ms:.3f} ms per round"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"arguments": vars(args), "overhead_ms": {"p50": p50, "p99": p99}, "loop_cpu_ms_per_round": cpu_ms}
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
