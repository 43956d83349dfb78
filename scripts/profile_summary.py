#!/usr/bin/env python
"""The top frames of a py-spy raw profile, per process: where a round's host time goes.

Record the round path's three processes (the coordinator in round_overhead.py, the draft and
target services it starts) with py-spy, then summarise the steady state (stacks under FRAME):

    .venv/bin/py-spy record -r 200 --subprocesses -f raw -o prof.txt -- \\
        .venv/bin/python scripts/round_overhead.py --streams 1 --rounds 200 --temperature 0.7
    .venv/bin/python scripts/profile_summary.py prof.txt --within Runner.run --within MicroBatcher._drain

Each process's table gives the share of its samples (inside any --within frame) that each
function is on the stack of (inclusive), then the leaves (self time).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def frame_name(frame: str) -> str:
    """'func (path/file.py:12)' -> 'func file.py:12'."""
    m = re.match(r"(.*) \((.*?)(?::(\d+))?\)$", frame)
    if not m:
        return frame
    return f"{m.group(1)} {Path(m.group(2)).name}:{m.group(3) or ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--within", action="append", default=[], help="count only stacks holding this frame text")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    samples: collections.Counter[str] = collections.Counter()
    for line in args.profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        # With --subprocesses the innermost 'process N:"cmd"' frame names the process the stack is from.
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        proc = frames[procs[-1]].split(":", 1)[1][:70] if procs else "main"
        body = frames[procs[-1] + 1 :] if procs else frames
        if args.within and not any(w in f for w in args.within for f in body):
            continue
        n = int(count)
        samples[proc] += n
        for name in {frame_name(f) for f in body}:
            inclusive[proc][name] += n
        if body:
            leaves[proc][frame_name(body[-1])] += n
    for proc, n in samples.most_common():
        print(f"\n## {proc} ({n} samples)\n\n| inclusive | function |\n|---|---|")
        for name, c in inclusive[proc].most_common(args.top):
            print(f"| {c / n * 100:.1f}% | `{name}` |")
        print("\n| self | function |\n|---|---|")
        for name, c in leaves[proc].most_common(args.top // 2):
            print(f"| {c / n * 100:.1f}% | `{name}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
