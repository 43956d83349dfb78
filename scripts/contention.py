"""Target-only tokens/s with and without a one-core busy loop beside it, old and new thread defaults.

Issue #19 found a 2-thread target about 25x slower whenever another process
took CPU (OpenMP threads spinning between parallel regions); specd then
waited passively, which made multi-token verifies twice as slow (issue 28);
now it spins and governs its thread count (specd.serving.cpu_threads). This
starts target-only clusters (target + coordinator, no draft) side by side:

  before: 2 threads, OMP_WAIT_POLICY=PASSIVE (specd's defaults before the governor)
  after:  specd's defaults (--torch-threads 0: up to the CPUs available, fewer while
          other processes take them; OpenMP's own wait policy)
  spin-2t (--also-spin): 2 fixed threads with OpenMP's own wait policy (what issue #19 found collapsing;
          beside the busy loop it takes minutes per measurement)

and measures, interleaved so that both see the same background load, each
cluster quiet and then with a busy loop (`while True: pass` in another
process) running. It prints one line per measurement and a markdown table of
medians, and writes JSON.

    python scripts/contention.py                    # demo target, 5 rounds
    python scripts/contention.py --rounds 9 --tokens 48 --json contention.json

On a shared machine absolute figures are noisy; the busy/quiet ratio of each
round is measured back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import CoordinatorClient
from specd.tools.localcluster import LocalCluster

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def tokens_per_s(address: str, tokens: int, requests: int) -> float:
    """Target-only greedy decoding: completion tokens over wall time, `requests` calls in a row."""
    with CoordinatorClient(address, timeout=600) as client:
        client.generate(PROMPT, max_new_tokens=4, temperature=0, speculation="off")  # warm
        start = time.perf_counter()
        done = 0
        for _ in range(requests):
            reply = client.generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True, speculation="off")
            done += len(reply.token_ids)
        return done / (time.perf_counter() - start)


def busy_loop() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo", help="target model folder or 'demo' (default: demo)")
    parser.add_argument("--rounds", type=int, default=5, help="quiet/busy pairs per setting (default: 5)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default: 32)")
    parser.add_argument("--requests", type=int, default=2, help="requests per measurement (default: 2)")
    parser.add_argument("--before-threads", type=int, default=2, help="the old default (default: 2)")
    parser.add_argument("--also-spin", action="store_true", help="add 2 fixed threads with OpenMP's own wait policy")
    parser.add_argument(
        "--also-threads", type=int, default=0, help="add a third setting: specd's defaults with this many threads"
    )
    parser.add_argument("--json", default="", help="write the measurements here")
    args = parser.parse_args()

    settings = {
        "before": LocalCluster(args.target, None, target_threads=args.before_threads, ready_timeout_s=900),
        "after": LocalCluster(args.target, None, target_threads=0, ready_timeout_s=900),
    }
    settings["before"].env["OMP_WAIT_POLICY"] = "PASSIVE"
    # OMP_WAIT_POLICY="" is OpenMP's own default (an empty value is ignored), as specd's is now.
    settings["after"].env["OMP_WAIT_POLICY"] = ""
    if args.also_spin:
        settings["spin-2t"] = LocalCluster(args.target, None, target_threads=2, ready_timeout_s=900)
        settings["spin-2t"].env["OMP_WAIT_POLICY"] = ""
    if args.also_threads:
        settings[f"after-{args.also_threads}t"] = LocalCluster(
            args.target, None, target_threads=args.also_threads, ready_timeout_s=900
        )
        settings[f"after-{args.also_threads}t"].env["OMP_WAIT_POLICY"] = ""
    results: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name in settings}
    try:
        for cluster in settings.values():
            cluster.start()
        for name, cluster in settings.items():
            threads = [line.strip() for line in cluster.target.lines if "threads:" in line]
            print(f"{name}: {threads[-1] if threads else '(no threads line)'}", flush=True)
        for r in range(args.rounds):
            for name, cluster in settings.items():
                quiet = tokens_per_s(cluster.address, args.tokens, args.requests)
                loop = busy_loop()
                try:
                    time.sleep(0.5)
                    busy = tokens_per_s(cluster.address, args.tokens, args.requests)
                finally:
                    loop.kill()
                    loop.wait()
                results[name]["quiet"].append(quiet)
                results[name]["busy"].append(busy)
                print(
                    f"round {r + 1} {name:9s} quiet {quiet:6.2f} tok/s  busy {busy:6.2f} tok/s  "
                    f"ratio {busy / quiet:.2f}",
                    flush=True,
                )
    finally:
        for cluster in settings.values():
            cluster.stop()

    print(f"\nCPUs available: {len(os.sched_getaffinity(0))}; load average now {os.getloadavg()[0]:.1f}")
    print("| setting | quiet tok/s (median) | busy tok/s (median) | busy/quiet per round (median, min-max) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        ratios = [b / q for q, b in zip(r["quiet"], r["busy"])]
        print(
            f"| {name} | {statistics.median(r['quiet']):.2f} | {statistics.median(r['busy']):.2f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
