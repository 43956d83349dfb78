#!/usr/bin/env python
"""How much a flood of maximal prompts slows a concurrent stream: the coordinator's event loop under load.

One streaming request (target-only, greedy, one token per message) is timed
message by message, alone ("quiet") and while `--flood` other callers each
send a prompt of the coordinator's maximal length (its --max-prompt-chars,
32 characters per token of the context by default) at the same moment. The
two phases alternate `--repeats` times in one run. The flood runs in a process
of its own, so its clients' work never slows the timed stream's client. Prints
the inter-token gap p50 / p99 of each phase and the p99 ratio (issue 31 asks
< 3x).

    .venv/bin/python scripts/prompt_load.py                      # emulated h100-8b target (sim), byte tokenizer
    .venv/bin/python scripts/prompt_load.py --target demo        # the demo target and its BPE tokenizer

With an emulated target (sim:...) the model's steps take the profile's time: emulated.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import threading
import time
from multiprocessing.synchronize import Event
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from coordinator.client import CoordinatorClient
from specd.tools.localcluster import LocalCluster

WORDS = "The quick brown fox jumps over the lazy dog, naive cafe 123; "


def _stream_gaps(address: str, tokens: int, ready: Event | None = None) -> list[float]:
    """Seconds between the stream's messages after the first (each message one round: one token)."""
    times: list[float] = []
    with CoordinatorClient(address, timeout=300) as client:
        for _ in client.generate_stream(
            "Count with me: one two three", max_new_tokens=tokens, temperature=0.0, ignore_eos=True, speculation="off"
        ):
            times.append(time.perf_counter())
            if ready is not None and len(times) == 3:
                ready.set()  # the stream runs: let the flood go
    return [b - a for a, b in itertools.pairwise(times[1:])]


def _flood(address: str, n: int, chars: int, go: Event, results: multiprocessing.Queue) -> None:
    """n callers at once (connected before `go`), each with a prompt of `chars` characters; their status
    codes go to `results` (refused or not, each prompt is tokenized)."""
    text = (WORDS * (chars // len(WORDS) + 1))[:chars]
    clients = [CoordinatorClient(address, timeout=300) for _ in range(n)]
    for c in clients:
        c.model_info()  # connected now, not during the timed window
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(client: CoordinatorClient) -> None:
        go.wait(120)
        try:
            client.generate(text, max_new_tokens=1, temperature=0.0)
            outcome = "OK"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for c in clients:
        c.close()
    results.put(outcomes)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="sim:h100-8b", help="target model (default: the emulated h100-8b)")
    ap.add_argument("--tokens", type=int, default=96, help="tokens the timed stream generates")
    ap.add_argument("--flood", type=int, default=32, help="maximal prompts sent at once beside it")
    ap.add_argument("--repeats", type=int, default=3, help="quiet / flood phase pairs, alternating")
    ap.add_argument("--coordinator-args", default="", help="extra `specd serve coordinator` flags")
    args = ap.parse_args()
    quiet: list[float] = []
    flooded: list[float] = []
    outcomes: list[str] = []
    spawn = multiprocessing.get_context("spawn")
    with LocalCluster(args.target, None, coordinator_args=args.coordinator_args.split()) as cluster:
        with CoordinatorClient(cluster.address, timeout=60) as client:
            chars = 32 * client.model_info().max_context  # the default --max-prompt-chars
        _stream_gaps(cluster.address, 8)  # warm-up
        for r in range(args.repeats):
            quiet += _stream_gaps(cluster.address, args.tokens)
            go, results = spawn.Event(), spawn.Queue()
            flood = spawn.Process(target=_flood, args=(cluster.address, args.flood, chars, go, results))
            flood.start()
            time.sleep(3.0)  # its clients connect (and its interpreter starts) before the timed stream
            flooded += _stream_gaps(cluster.address, args.tokens, ready=go)
            outcomes += results.get(timeout=300)
            flood.join(60)
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    report = {
        "target": args.target,
        "emulated": args.target.startswith("sim:"),  # the model's steps take a profile's time
        "prompt_chars": chars,
        "flood": args.flood,
        "flood_outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
        "quiet_gap_ms": {"p50": 1e3 * statistics.median(quiet), "p99": 1e3 * _quantile(quiet, 0.99)},
        "flood_gap_ms": {"p50": 1e3 * statistics.median(flooded), "p99": 1e3 * _quantile(flooded, 0.99)},
    }
    report["p99_ratio"] = report["flood_gap_ms"]["p99"] / report["quiet_gap_ms"]["p99"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
