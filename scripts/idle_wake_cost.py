#!/usr/bin/env python
"""What the first piece of host work costs after a process has slept, on this machine.

A service of the emulated pair sleeps through every modelled pass and between requests (a draft
service idles through a stretch of target-only rounds). This times one small piece of work right
after sleeping for each gap, against the same work back to back: a pure-Python loop, a numpy pass
over a vocabulary-sized float32 row, a greedy draft step's sampling (specd's argmax and top
probability over one row of logits, the work after every emulated draft pass at T = 0), and the
emulated draft model's logits for one context (SimLM.logits, computed inside an emulated pass,
which must stay under its modelled time). Median
and max ms per gap, one torch thread as the services run. The figures in
docs/results/emulated/auto-t07-2026-12-06/README.md:

    .venv/bin/python scripts/idle_wake_cost.py --gaps 0,0.005,0.05,0.5
    .venv/bin/python scripts/idle_wake_cost.py --gaps 0,0.005,0.02   # a pass's own sleep (docs/performance.md)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from measure_args import floats

from specd.core.model.sim import parse_sim_spec
from specd.core.sampling.greedy import greedy_tokens, top_probability


def timed_after(work: Callable[[int], object], gap_s: float, repeats: int) -> tuple[float, float]:
    """(median, max) ms of `work` run right after sleeping gap_s, `repeats` times."""
    xs = []
    for i in range(repeats):
        if gap_s > 0:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        work(i)
        xs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(xs), max(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", default="0,0.005,0.05,0.5", help="seconds slept before each timed piece")
    parser.add_argument("--profile", default="h100-8b,agreement=0.8", help="the emulated pair whose draft logits run")
    parser.add_argument("--seconds", type=float, default=4.0, help="about how long each gap's repeats sleep in all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = parse_sim_spec(f"sim:{args.profile}").runner("draft").lm
    row = np.random.default_rng(0).random(lm.vocab_size, dtype=np.float32)

    def python_loop(_: int) -> int:
        return sum(range(20000))

    def numpy_row(_: int) -> float:
        return float((row * 2.0 + 1.0).sum())

    logits = torch.from_numpy(row)[None]  # [1, V]

    def greedy_step(_: int) -> object:
        best, _bad = greedy_tokens(logits)
        return top_probability(logits, best).tolist()

    def sim_logits(i: int) -> object:
        return lm.logits([[i, i + 1, i + 2]])

    works = {
        "python loop": python_loop,
        f"numpy pass over [{lm.vocab_size}]": numpy_row,
        f"greedy step over [1, {lm.vocab_size}]": greedy_step,
        "SimLM.logits, 1 row": sim_logits,
    }
    print("| work | " + " | ".join(f"after {g:g} s: median / max ms" for g in floats(args.gaps)) + " |")
    print("|---|" + "---|" * len(floats(args.gaps)))
    for name, work in works.items():
        for i in range(30):
            work(i)  # warm
        cells = []
        for gap in floats(args.gaps):
            repeats = 30 if gap <= 0 else max(5, min(30, int(args.seconds / gap)))
            med, top = timed_after(work, gap, repeats)
            cells.append(f"{med:.3f} / {top:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
