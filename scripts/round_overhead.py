#!/usr/bin/env python
"""The coordinator's per-round overhead on loopback, hop by hop.

Overhead of a round = its wall time at the coordinator minus the draft's and
the target's own compute (as they report it). Draft and target run as their
own processes (`specd serve`); the coordinator runs in this process, so its
round records (with each call's hops, specd.core.transit) and the CPU time of
its event-loop thread can be read directly. Every stream runs fixed-K rounds
(auto's, K up to --draft-length, with --speculation auto; target-only with
--draft-length 0) at the given temperature, as one request or as requests of
--request-tokens tokens one after another. Each setting also prints its tokens/s
and the rounds it ran per arm (pipeline, K asked): what auto chose, beside a fixed
mode's run of the same tokens.

    .venv/bin/python scripts/round_overhead.py                       # emulated h100-tp2-70b, 1 and 32 streams
    .venv/bin/python scripts/round_overhead.py --model sim:h100-8b --streams 1 --rounds 400
    .venv/bin/python scripts/round_overhead.py --target DIR --draft DIR   # real models
    .venv/bin/python scripts/round_overhead.py --model 'sim:h100-8b,agreement=0' --streams 1 \
        --speculation auto --pipeline auto --request-tokens 48     # auto's rounds, 48-token requests
    .venv/bin/python scripts/round_overhead.py --model sim:h100-8b --streams 1 --draft-length 2 \
        --pipeline spec-cache --branch-budget 8 [--fixed-branch-budget]  # the speculation cache's budget
    .venv/bin/python scripts/round_overhead.py --streams 1 --profile docs/results/round-profile/t0
    .venv/bin/python scripts/round_overhead.py --model 'sim:h100-8b,agreement=0' --streams 32 \
        --request-tokens 8 --draft-length 4 --speculation auto --pipeline auto --rounds 512  # auto at 32 streams
    .venv/bin/python scripts/round_overhead.py --streams 32 --rounds 1500 --service-args '--batch-wait-ms 0'  # service flags

--profile DIR attaches py-spy (`--profile-rate` Hz; non-blocking, or pausing the process for
each sample with --profile-native, which adds C frames; --profile-gil: only GIL-holding samples) to the coordinator (this process) and to both services
for each measured setting, after the warm-up, and writes DIR/s{streams}-{process}.txt (raw
stacks, for scripts/profile_summary.py) and .svg (a flame graph, scripts/flamegraph_svg.py).
--coordinator-extra-us N spins N us of the coordinator's CPU before each request it sends a peer:
how much of the coordinator's own CPU per round its rounds wait for (docs/performance.md).

With an emulated model (sim:...) every figure is emulated: the services, the
batching and the sampler are real, the forward passes take the profile's time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from measure_args import ints

from coordinator import peers as coordinator_peers
from coordinator.client import build_request
from coordinator.server import create_server
from specd.core.rounds.record import RoundRecord
from specd.core.rounds.steps import DEFAULT_BRANCH_BUDGET
from specd.core.transit import HOPS
from specd.serving.config import CoordinatorConfig
from specd.serving.server import run_event_loop
from specd.tools.localcluster import ServiceProcess
from specd.v1 import coordinator_pb2_grpc


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(records: list[RoundRecord]) -> dict[str, dict[str, float]]:
    """p50 / p99 of the round's wall, compute, overhead and each hop, in ms."""
    series: dict[str, list[float]] = {
        "wall": [r.wall_ms for r in records],
        "draft compute": [r.draft_ms for r in records if r.draft_tokens],
        "verify compute": [r.verify_ms for r in records],
        "overhead": [r.overhead_ms for r in records],
        "coordinator loop": [r.loop_ms for r in records if r.loop_ms is not None],
    }
    for peer, get in (("draft", lambda r: r.draft_transit), ("target", lambda r: r.verify_transit)):
        transits = [t for t in (get(r) for r in records) if t is not None]
        for hop in HOPS:
            series[f"{peer} {hop}"] = [getattr(t, f"{hop}_ms") for t in transits]
    return {name: {"p50": quantile(v, 0.5), "p99": quantile(v, 0.99), "n": len(v)} for name, v in series.items()}


def arms(records: list[RoundRecord]) -> list[dict[str, object]]:
    """The rounds per arm (pipeline, K asked): how many, their tokens and wall, and pipeline hits: what auto ran."""
    groups: dict[tuple[str, int], list[RoundRecord]] = {}
    for r in records:
        groups.setdefault((r.pipeline if r.draft_length else "target-only", r.draft_length), []).append(r)
    return [
        {
            "pipeline": pipeline,
            "k": k,
            "rounds": len(rs),
            "tokens_per_round": sum(r.tokens for r in rs) / len(rs),
            "wall_ms_p50": quantile([r.wall_ms for r in rs], 0.5),
            "pipeline_hits": sum(r.pipeline_hit is not None for r in rs),
        }
        for (pipeline, k), rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]


async def run_streams(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    streams: int,
    tokens: int,
    k: int,
    t: float,
    pipeline: str = "off",
    speculation: str = "fixed",
    request_tokens: int = 0,
    top_p: float = 1.0,
) -> None:
    """Each stream generates `tokens` tokens: one request, or requests of `request_tokens` one after another."""

    async def one(i: int) -> None:
        left, n = tokens, 0
        while left > 0:
            size = min(left, request_tokens or left)
            await stub.Generate(
                build_request(
                    f"stream {i}, request {n}: the quick brown fox",
                    max_new_tokens=size,
                    temperature=t,
                    top_p=top_p,
                    # A seeded request pins auto's K (reproducible). Each request its own seed: with one seed
                    # per stream every request drew the same coins at the same positions, and as the
                    # emulated model reads only the last few tokens their texts converged to one, so a
                    # fixed mode at T > 0 measured one short sample's acceptance over and over (emulated
                    # h100-8b, agreement 0.95, T = 0.7, K = 3: 3.88-4.00 tokens a round, auto 3.60-3.67).
                    seed=None if speculation == "auto" else i * 1_000_003 + n,
                    ignore_eos=True,
                    speculation=speculation if k else "off",
                    draft_length=k or 4,
                    pipeline=pipeline,
                )
            )
            left, n = left - size, n + 1

    await asyncio.gather(*(one(i) for i in range(streams)))


class Profiler:
    """py-spy on each round-path process while one setting runs (--profile)."""

    def __init__(self, args: argparse.Namespace, pids: dict[str, int], streams: int) -> None:
        self.dir = Path(args.profile)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.outputs: dict[str, Path] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        spy = str(Path(sys.executable).with_name("py-spy"))
        for name, pid in pids.items():
            out = self.dir / f"s{streams}-{name}.txt"
            cmd = [spy, "record", "--pid", str(pid), "--rate", str(args.profile_rate), "--format", "raw"]
            cmd += ["--output", str(out)]
            cmd += [] if args.profile_native else ["--nonblocking"]  # native stacks need the process paused
            cmd += ["--gil"] if args.profile_gil else []
            cmd += ["--native"] if args.profile_native else []
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.outputs[name] = out
        time.sleep(1.0)  # py-spy attaches

    def stop(self, title: str) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for proc in self.procs:
            proc.wait(60)
        draw = Path(__file__).with_name("flamegraph_svg.py")
        for name, out in self.outputs.items():
            if out.exists():
                svg = out.with_suffix(".svg")
                subprocess.run([sys.executable, str(draw), str(out), "-o", str(svg), "--title", f"{title}: {name}"])


@contextlib.contextmanager
def extra_request_cpu(microseconds: float) -> Iterator[None]:
    """Spend this much more of the coordinator's CPU on each request it sends a peer (a spin before
    PeerStream.request), for as long as the block runs: how much of the coordinator's own CPU per round
    reaches the round's overhead (--coordinator-extra-us). A probe: nothing of specd changes."""
    if microseconds <= 0:
        yield
        return
    cls = coordinator_peers.PeerStream
    request = cls.request
    seconds = microseconds / 1e6

    def spun(self: Any, msg: Any, timeout: float) -> Any:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass
        return request(self, msg, timeout)

    setattr(cls, "request", spun)  # noqa: B010 - a probe replaces the method for this process
    try:
        yield
    finally:
        setattr(cls, "request", request)  # noqa: B010


async def measure(args: argparse.Namespace) -> list[dict[str, object]]:
    common = ["--port", "0", "--log-level", "WARNING", "--event-loop", args.event_loop]
    common += ["--gil-switch-ms", str(args.gil_switch_ms), *args.service_args.split()]
    target_args = ["target", "--model", args.target, *common]
    draft_args = ["draft", "--model", args.draft, "--target-model", args.target, *common]
    peers = [ServiceProcess("target", target_args), ServiceProcess("draft", draft_args)]
    for p in peers:
        p.start()
    out: list[dict[str, object]] = []
    try:
        addresses = [p.wait_ready(300) for p in peers]
        config = CoordinatorConfig(
            target=addresses[0],
            draft=addresses[1],
            tokenizer=args.target,
            port=0,
            branch_budget=args.branch_budget,
            adapt_branch_budget=not args.fixed_branch_budget,
        )
        handle, engine = await create_server(config)
        await handle.server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            await run_streams(
                stub, 1, 16, args.draft_length, args.temperature, args.pipeline, args.speculation, top_p=args.top_p
            )  # warm-up
            for streams in args.streams:
                tokens = max(8, args.rounds * max(1, args.draft_length) // streams)
                engine.round_records.clear()
                profiler = None
                if args.profile:
                    pids = {"coordinator": os.getpid(), "draft": peers[1].pid, "target": peers[0].pid}
                    profiler = Profiler(args, {k: v for k, v in pids.items() if v is not None}, streams)
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                with extra_request_cpu(args.coordinator_extra_us):
                    await run_streams(
                        stub,
                        streams,
                        tokens,
                        args.draft_length,
                        args.temperature,
                        args.pipeline,
                        args.speculation,
                        args.request_tokens,
                        args.top_p,
                    )
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
                if profiler is not None:
                    profiler.stop(f"{args.target} K={args.draft_length} T={args.temperature} streams={streams}")
                records = [r for r in engine.round_records if r.index > 0]  # the first round opens sessions
                stats, ran = summary(records), arms(records)
                out.append(
                    {
                        "streams": streams,
                        "rounds": len(records),
                        "loop_cpu_ms_per_round": cpu / max(1, len(engine.round_records)) * 1e3,
                        "pipeline_hits": sum(r.pipeline_hit is not None for r in records),
                        "staged": sum(r.staged for r in records),
                        "wall_s": wall,
                        "tokens_per_s": sum(r.tokens for r in engine.round_records) / wall,
                        "ms": stats,
                        "arms": ran,
                    }
                )
                print(
                    f"\n{args.target} K={args.draft_length} pipeline {args.pipeline} T={args.temperature}{f' top-p {args.top_p}' if args.top_p < 1 else ''} streams={streams} "
                    f"event loop {args.event_loop}, GIL switch {args.gil_switch_ms} ms: "
                    f"{len(records)} rounds ({out[-1]['pipeline_hits']} pipeline hits, {out[-1]['staged']} staged), "
                    f"coordinator event-loop CPU {out[-1]['loop_cpu_ms_per_round']:.3f} ms per round, "
                    f"{out[-1]['tokens_per_s']:.1f} tokens/s"
                )
                print(
                    "arms run (pipeline K: rounds, tokens a round, wall p50 ms, pipeline hits): "
                    + "; ".join(
                        f"{a['pipeline']} {a['k']}: {a['rounds']}, {a['tokens_per_round']:.2f}, {a['wall_ms_p50']:.2f}, "
                        f"{a['pipeline_hits']}"
                        for a in ran
                    )
                )
                print(f"{'':18s} {'p50 ms':>9s} {'p99 ms':>9s}")
                for name, s in stats.items():
                    if s["n"]:
                        print(f"{name:18s} {s['p50']:9.3f} {s['p99']:9.3f}")
        await handle.stop(1.0)
    finally:
        for p in peers:
            p.stop(10)
    return out


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (argv; None: sys.argv), the defaults filled in as `measure` reads them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sim:h100-tp2-70b", help="both services' model (sim:PROFILE or a folder)")
    parser.add_argument("--target", default="", help="target model (default: --model)")
    parser.add_argument("--draft", default="", help="draft model (default: --model)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=300, help="about this many rounds per setting")
    parser.add_argument("--draft-length", type=int, default=4, help="fixed K (0: target-only rounds)")
    parser.add_argument(
        "--speculation", default="fixed", choices=["fixed", "auto"], help="fixed K, or auto with K up to --draft-length"
    )
    parser.add_argument(
        "--request-tokens", type=int, default=0, help="each stream's requests' length (0: one request per stream)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0, help="the requests' top-p (1: off)")
    parser.add_argument(
        "--pipeline", default="off", help="the requests' pipeline: off, bonus-match, post-verify, spec-cache, auto"
    )
    parser.add_argument(
        "--branch-budget",
        type=int,
        default=DEFAULT_BRANCH_BUDGET,
        help="spec-cache: the most verdicts pre-drafted per round",
    )
    parser.add_argument(
        "--fixed-branch-budget", action="store_true", help="spec-cache: always --branch-budget verdicts (no adapting)"
    )
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--profile", default="", help="py-spy each process into this folder (see above)")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--profile-gil", action="store_true", help="py-spy --gil: only samples holding the GIL")
    parser.add_argument("--profile-native", action="store_true", help="py-spy --native: C frames too")
    parser.add_argument("--gil-switch-ms", type=float, default=1.0, help="every process's GIL switch interval")
    parser.add_argument(
        "--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"], help="every process's event loop"
    )
    parser.add_argument(
        "--service-args", default="", help="extra flags for both services, one string (e.g. '--batch-wait-ms 10')"
    )
    parser.add_argument(
        "--coordinator-extra-us",
        type=float,
        default=0.0,
        help="spin this many microseconds of the coordinator's CPU per request it sends a peer (a probe, see "
        "extra_request_cpu)",
    )
    args = parser.parse_args(argv)
    args.target = args.target or args.model
    args.draft = args.draft or args.model
    args.streams = ints(args.streams)
    return args


def main() -> None:
    args = parse_arguments()
    sys.setswitchinterval(args.gil_switch_ms / 1e3)  # as the services do (--gil-switch-ms)
    results = run_event_loop(measure(args), args.event_loop)
    if args.json:
        Path(args.json).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
