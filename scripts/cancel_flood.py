#!/usr/bin/env python
"""What abandoned requests leave behind: a probe's latency and the coordinator's memory after a cancel flood.

`--flood` requests with prompts near the context limit are sent in waves of
`--wave` at once, each wave cancelled `--cancel-after-ms` after it was sent,
the next sent at once: a cancelled request frees its admission slot at once,
so every wave is admitted. Each had its draft and
target work (a prefill of the whole prompt) on its way; the coordinator's
close withdraws what is still queued there (specd.serving.round_servicing),
so the backlog they leave is at most the batches already running. Before the flood a short
greedy probe is timed `--probes` times (the quiet figure); after it, probes
run back to back for `--watch-s` seconds (one that admission refuses while the
flood's work still holds slots counts as not back). Prints the quiet p50,
each later probe's latency against it, when the probes came back within 20%
(and stayed), and the coordinator's RSS before and after.

    .venv/bin/python scripts/cancel_flood.py                  # emulated h100-8b target and draft (sim)

With emulated models (sim:...) the forward passes take the profile's time: emulated.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from coordinator.client import CoordinatorClient, build_request
from specd.tools.localcluster import LocalCluster
from specd.v1 import coordinator_pb2_grpc

PROBE = "Count with me: one two three four"


def _rss(pid: int) -> int:
    """VmRSS of a process in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _probe(client: CoordinatorClient) -> float:
    """Seconds a short greedy request takes; inf when admission refused it (the flood's work still holds slots)."""
    t0 = time.perf_counter()
    try:
        client.generate(PROBE, max_new_tokens=16, temperature=0.0, ignore_eos=True, speculation="fixed", draft_length=4)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        time.sleep(0.01)
        return math.inf
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sim:h100-8b", help="target and draft model (default: emulated h100-8b)")
    ap.add_argument("--flood", type=int, default=200, help="requests sent and cancelled")
    ap.add_argument("--wave", type=int, default=50, help="requests sent at once (under --max-concurrent-requests)")
    ap.add_argument("--cancel-after-ms", type=float, default=150.0, help="how long after sending a wave is cancelled")
    ap.add_argument("--probes", type=int, default=9, help="quiet probes before the flood")
    ap.add_argument("--watch-s", type=float, default=5.0, help="how long probes run after the flood")
    args = ap.parse_args()
    rng = random.Random(0)
    with LocalCluster(args.model, args.model) as cluster:
        pid = cluster.coordinator.pid if cluster.coordinator is not None else None
        assert pid is not None, "the cluster has no coordinator process"
        with CoordinatorClient(cluster.address, timeout=120) as client:
            info = client.model_info()
            for _ in range(3):
                _probe(client)  # warm-up
            quiet = statistics.median(_probe(client) for _ in range(args.probes))
            rss_before = _rss(pid)
            n = info.max_context - 32
            channel = grpc.insecure_channel(cluster.address)
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            calls = []
            requests = [
                build_request(
                    [rng.randrange(300, info.vocab_size) for _ in range(n)],
                    max_new_tokens=16,
                    temperature=0.0,
                    speculation="fixed",
                    draft_length=4,
                )
                for _ in range(args.flood)
            ]
            flood_start = time.perf_counter()
            for at in range(0, len(requests), args.wave):
                wave = [stub.Generate.future(req, timeout=120) for req in requests[at : at + args.wave]]
                time.sleep(args.cancel_after_ms / 1e3)
                for call in wave:
                    call.cancel()
                calls += wave
            flood_end = time.perf_counter()
            codes = [c.code().name if c.done() and c.code() else "CANCELLED" for c in calls]
            after = []
            while time.perf_counter() - flood_end < args.watch_s:
                start = time.perf_counter() - flood_end
                after.append((start, _probe(client)))
            rss_after = _rss(pid)
            channel.close()
    back = next(
        (t for i, (t, _) in enumerate(after) if all(s <= 1.2 * quiet for _, s in after[i:])), None
    )  # from this probe on, every probe within 20% of quiet
    report = {
        "model": args.model,
        "emulated": args.model.startswith("sim:"),  # forward passes take a profile's time
        "flood": args.flood,
        "prompt_tokens": n,
        "flood_codes": {k: codes.count(k) for k in sorted(set(codes))},
        "flood_s": flood_end - flood_start,
        "quiet_probe_ms": 1e3 * quiet,
        "probes_after_ms": [[round(t, 3), round(1e3 * s, 1) if s < math.inf else "refused"] for t, s in after],
        "back_within_20pct_after_s": back,
        "coordinator_rss_mib": {"before": rss_before / 2**20, "after": rss_after / 2**20},
        "coordinator_rss_growth_mib": (rss_after - rss_before) / 2**20,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
