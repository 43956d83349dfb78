#!/usr/bin/env python3
"""Scale-out on emulated accelerators: one coordinator over 1, 2, 4, 8 target replicas (emulated).

For each replica count N it starts N target replicas (and N draft replicas
unless --drafts-per-target 0) as `specd serve ... --model sim:PROFILE`
processes on 127.0.0.1, one coordinator given all their addresses, and
drives --streams-per-replica x N concurrent GenerateStream calls (one
asyncio client process) for --seconds after --warmup. It reports the
aggregate tokens/s, the split of sessions over the target replicas (the
coordinator's specd:replica_placements_total) and the efficiency against
linear scaling from N = 1: tokens/s(N) / (N x tokens/s(1)).

Over the measured window it also reports the coordinator's capacity, its
rounds per CPU-second of its own process (`specd:spec_decode_num_rounds`
over the process's user + system CPU time), the CPU seconds of the model
services and of this client, and how busy the machine's cores were: a
machine near 1.0 busy means the host, not specd's design, set the figure
(raise the profile's time_scale).

Every figure is emulated: the model services' forward passes take the
profile's modelled time (docs/performance.md), the rest (gRPC, batching,
sessions, sampling, the coordinator) is real and runs on this machine's
CPUs, so the coordinator's own cost per round is what limits scaling.

    PYTHONPATH=. python scripts/scale_bench.py --profile h100-8b --replicas 1,2,4,8 \\
        --streams-per-replica 16 --seconds 30 --json scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure_args import ints

from coordinator.client import build_request
from specd.core.model.sim import EMULATED, parse_sim_spec
from specd.tools.localcluster import LocalCluster, ServiceProcess
from specd.v1 import coordinator_pb2_grpc

READY_S = 180.0


def metrics(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of one process so far (0 once it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


# The coordinator's histograms whose mean over the window is reported, and the labels that name a series.
HISTOGRAMS = {"specd:round_seconds": ("part",), "specd:round_hop_seconds": ("peer", "hop")}


class WindowCost:
    """CPU, rounds and the round histograms' sums and counts at the start and end of the measured window."""

    def __init__(self, cluster: LocalCluster) -> None:
        assert cluster.coordinator is not None
        self.coordinator = cluster.coordinator
        self.services = [s.pid for s in (*cluster.targets, *cluster.drafts)]
        self.marks: list[dict[Any, float]] = []

    def mark(self) -> None:
        busy, total = machine_ticks()
        mark: dict[Any, float] = {
            "coordinator_cpu_s": cpu_seconds(self.coordinator.pid),
            "services_cpu_s": sum(cpu_seconds(pid) for pid in self.services),
            "client_cpu_s": cpu_seconds(os.getpid()),
            "rounds": 0.0,
            "busy": busy,
            "total": total,
        }
        for (name, labels), value in metrics(metrics_address(self.coordinator)).items():
            base, _, stat = name.rpartition("_")
            if name == "specd:spec_decode_num_rounds_total":
                mark["rounds"] += value
            elif base in HISTOGRAMS and stat in ("sum", "count"):
                label = " ".join(dict(labels)[k] for k in HISTOGRAMS[base])
                mark[(base, label, stat)] = value  # e.g. ("specd:round_hop_seconds", "draft queue", "sum")
        self.marks.append(mark)

    def summary(self) -> dict[str, Any]:
        start, end = self.marks
        d = {key: end[key] - start.get(key, 0.0) for key in end}
        mean_ms = {  # (histogram, series) -> mean ms over the window's samples
            key[:2]: 1e3 * d[key] / d[(*key[:2], "count")]
            for key in d
            if isinstance(key, tuple) and key[2] == "sum" and d.get((*key[:2], "count"))
        }
        cpu = d["coordinator_cpu_s"]
        return {
            # a round's split at the coordinator: draft, verify, overhead
            **{f"round_{part}_ms_mean": ms for (base, part), ms in mean_ms.items() if base == "specd:round_seconds"},
            "hop_ms_mean": {
                hop: round(ms, 3) for (base, hop), ms in mean_ms.items() if base == "specd:round_hop_seconds"
            },
            "coordinator_rounds": d["rounds"],
            "coordinator_cpu_s": cpu,
            "coordinator_rounds_per_cpu_s": d["rounds"] / cpu if cpu else 0.0,
            "services_cpu_s": d["services_cpu_s"],
            "client_cpu_s": d["client_cpu_s"],
            "machine_busy": d["busy"] / d["total"] if d["total"] else 0.0,
        }


def metrics_address(service: ServiceProcess) -> str:
    for line in service.lines:
        if line.startswith("specd-coordinator metrics on "):
            return line.split(" on ", 1)[1].strip()
    raise RuntimeError("the coordinator printed no metrics address")


async def drive(address: str, streams: int, args: argparse.Namespace, vocab: int, cost: WindowCost) -> dict[str, Any]:
    """streams concurrent request loops; tokens counted as they arrive inside the measured window."""
    rng = random.Random(0)
    window: dict[str, float] = {}
    counted = {"tokens": 0, "requests": 0, "failures": 0}
    stop = asyncio.Event()

    async def loop(worker: int) -> None:
        # a connection of its own per worker, as separate clients have (a shared one would carry all the
        # streams and meet the coordinator's --max-streams-per-connection)
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            while not stop.is_set():
                prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)]
                request = build_request(
                    prompt,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    ignore_eos=True,
                    speculation=args.speculation,
                    draft_length=args.draft_length,
                )
                try:
                    async for chunk in stub.GenerateStream(request, timeout=300):
                        now = time.monotonic()
                        if window.get("start", 1e18) <= now < window.get("end", 0):
                            counted["tokens"] += len(chunk.token_ids)
                    counted["requests"] += 1
                except grpc.aio.AioRpcError as exc:
                    counted["failures"] += 1
                    print(f"  request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)

    tasks = [asyncio.create_task(loop(i)) for i in range(streams)]
    await asyncio.sleep(args.warmup)
    await asyncio.to_thread(cost.mark)
    window["start"] = time.monotonic()
    window["end"] = window["start"] + args.seconds
    await asyncio.sleep(args.seconds)
    await asyncio.to_thread(cost.mark)
    stop.set()
    await asyncio.wait(tasks, timeout=120)
    return {**counted, "tokens_per_s": counted["tokens"] / args.seconds, **cost.summary()}


def run_one(n: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = args.model
    drafts = n * args.drafts_per_target
    cluster = LocalCluster(
        spec,
        spec if drafts else None,
        target_replicas=n,
        draft_replicas=max(1, drafts),
        target_args=[*args.service_args.split()],
        draft_args=[*args.service_args.split()],
        coordinator_args=[
            "--metrics-port",
            "0",
            "--max-concurrent-requests",
            str(max(64, 2 * n * args.streams_per_replica)),
            *args.coordinator_args.split(),
        ],
        ready_timeout_s=READY_S,
    )
    with cluster:
        assert cluster.coordinator is not None
        streams = n * args.streams_per_replica
        vocab = parse_sim_spec(spec).vocab_size
        result = asyncio.run(drive(cluster.address, streams, args, vocab, WindowCost(cluster)))
        placed = {
            dict(labels)["replica"]: value
            for (name, labels), value in metrics(metrics_address(cluster.coordinator)).items()
            if name == "specd:replica_placements_total" and dict(labels).get("role") == "target"
        }
    return {"target_replicas": n, "draft_replicas": drafts, "streams": streams, **result, "placements": placed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h100-8b", help="emulated profile, with overrides (e.g. h100-8b,time_scale=2)")
    p.add_argument("--replicas", default="1,2,4,8", help="target replica counts to run")
    p.add_argument("--streams-per-replica", type=int, default=16)
    p.add_argument("--drafts-per-target", type=int, default=1, help="draft replicas per target replica (0: none)")
    p.add_argument("--speculation", default="fixed", choices=["auto", "fixed", "off"])
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the measured window")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the measured window")
    p.add_argument("--service-args", default="", help="extra flags for every draft and target (one string)")
    p.add_argument("--coordinator-args", default="", help="extra flags for the coordinator (one string)")
    p.add_argument("--json", default="", help="write the records here")
    args = p.parse_args(argv)
    args.model = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    parse_sim_spec(args.model)  # fails early on an unknown profile
    records: list[dict[str, Any]] = []
    for n in ints(args.replicas):
        print(f"[{EMULATED}] {n} target replica(s), {n * args.streams_per_replica} streams ...", flush=True)
        record = run_one(n, args)
        base = records[0]["tokens_per_s"] / records[0]["target_replicas"] if records else None
        record["efficiency"] = record["tokens_per_s"] / (n * base) if base else 1.0
        records.append(record)
        shares = sorted(record["placements"].values())
        split = f"{min(shares) / sum(shares):.2f}-{max(shares) / sum(shares):.2f}" if shares and sum(shares) else "-"
        print(
            f"[{EMULATED}] targets {n}: {record['tokens_per_s']:.0f} tokens/s, efficiency {record['efficiency']:.2f} "
            f"of linear, session shares {split}, requests {record['requests']}, failures {record['failures']}; "
            f"coordinator {record['coordinator_rounds_per_cpu_s']:.0f} rounds per CPU-second "
            f"({record['coordinator_rounds']:.0f} rounds, {record['coordinator_cpu_s']:.1f} CPU-s), "
            f"services {record['services_cpu_s']:.1f} CPU-s, client {record['client_cpu_s']:.1f} CPU-s, "
            f"machine {record['machine_busy']:.0%} busy; a round's mean draft / verify / overhead "
            f"{record.get('round_draft_ms_mean', 0):.1f} / {record.get('round_verify_ms_mean', 0):.1f} / "
            f"{record.get('round_overhead_ms_mean', 0):.1f} ms; overhead by hop, mean ms: "
            + ", ".join(f"{hop} {ms:.1f}" for hop, ms in record["hop_ms_mean"].items()),
            flush=True,
        )
    meta = {"label": EMULATED, "profile": args.model, "args": vars(args), "cpus": os.cpu_count()}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    print(
        f"\n{'targets':>8} {'streams':>8} {'tokens/s':>10} {'vs linear':>10} {'coord rounds/CPU-s':>19} "
        f"{'machine busy':>13}   ({EMULATED}, {args.model})"
    )
    for r in records:
        print(
            f"{r['target_replicas']:>8} {r['streams']:>8} {r['tokens_per_s']:>10.0f} {r['efficiency']:>10.2f} "
            f"{r['coordinator_rounds_per_cpu_s']:>19.0f} {r['machine_busy']:>13.0%}"
        )
    return 0 if all(r["failures"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
