#!/usr/bin/env python
"""Time the demo target's verify forward against the tokens it runs: T(n) for n = 1 .. N, as the services run it.

What the adaptive controller has to know: what one more draft token costs a
round (specd.core.inprocess.adaptive, sigma). One session with a prompt of about 100
tokens; each sample appends n tokens, times the forward over them (n rows of
logits, as a verify of K = n - 1 draft tokens), and rolls back to keep one,
as a round does. The token counts are interleaved sample by sample so that
a noisy machine slows them all alike. Prints the median ms per n and
T(n)/T(1), with the thread and OpenMP settings beside them; --json writes them.

The settings are the target service's: its OpenMP environment (none of
specd's own: the runtime's defaults unless the caller set them) and, with
--threads 0 (the default, as `--torch-threads 0`), the thread governor on
the model's forward passes (specd.serving.cpu_threads), and its linear
layers (specd.core.model.cpu_linear: --cpu-linear packed, the default;
few-row, or torch for torch's own).

    .venv/bin/python scripts/verify_cost.py [--tokens 1,2,3,5,9,17] [--samples 40] [--threads 0]

Exits 0 with a message when the demo target is not available.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import ints

from scripts.batch_forward_speed import find_demo_target
from specd.core.model.cpu_linear import CPU_LINEARS
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.serving.cpu_budget import service_threads
from specd.serving.cpu_threads import attach_thread_governor, describe_threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,3,5,9,17", help="token counts n to time (comma-separated)")
    ap.add_argument("--samples", type=int, default=40, help="samples per n (after 3 warm-up rounds)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="as the target's --torch-threads (default 0: governed, the services' default)",
    )
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens in the KV cache")
    ap.add_argument("--cpu-linear", default=CPU_LINEARS[0], choices=CPU_LINEARS, help="as the services' --cpu-linear")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    counts = sorted(set(ints(args.tokens)))
    path = find_demo_target()
    if path is None:
        return 0
    threads = service_threads(args.threads)
    torch.set_num_threads(threads)
    runner = CausalLMRunner(load_pretrained(path).model, cpu_linear=args.cpu_linear)
    governor = attach_thread_governor(runner.model, args.threads, "cpu")
    settings = describe_threads(threads) + (", governed" if governor else ", fixed")
    settings += f"; --cpu-linear {args.cpu_linear}"
    rng = random.Random(0)
    session = runner.new_session([rng.randrange(runner.vocab_size) for _ in range(args.prompt)])
    runner.logits(session)  # prefill
    times: dict[int, list[float]] = {n: [] for n in counts}
    for i in range(args.samples + 3):
        for n in rng.sample(counts, len(counts)):
            runner.append(session, [rng.randrange(runner.vocab_size) for _ in range(n)])
            t0 = time.perf_counter()
            runner.logits(session, n)
            dt = (time.perf_counter() - t0) * 1e3
            runner.truncate(session, len(session) - n + 1)
            if len(session) > args.prompt + 64:  # keep the cache length about constant
                runner.truncate(session, args.prompt)
            if i >= 3:
                times[n].append(dt)
    medians = {n: statistics.median(v) for n, v in times.items()}
    base = medians[counts[0]]
    print(f"demo target, prompt {args.prompt} tokens, {args.samples} samples per n; {settings}")
    if governor is not None:
        print(f"  the governor changed the thread count {governor.changes} times; last: {governor.threads}")
    for n in counts:
        print(f"  n={n:3d}: {medians[n]:7.2f} ms   T(n)/T({counts[0]}) = {medians[n] / base:.3f}")
    if args.json:
        out = {
            "threads": args.threads,
            "settings": settings,
            "governor_changes": governor.changes if governor else None,
            "prompt_tokens": args.prompt,
            "samples": args.samples,
            "median_ms": {str(n): m for n, m in medians.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
