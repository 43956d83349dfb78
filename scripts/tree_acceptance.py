#!/usr/bin/env python
"""Tokens a round of the model drafter's trees and chains commit at T > 0, in-process (emulated).

One emulated pair at time_scale 0 (no modelled waiting), one session; every round drafts after
the committed prefix (a chain of K, or a tree of N nodes and D levels), verifies and commits.
Prints the mean tokens committed per round (acceptance length) per shape and agreement: what a
tree's shape buys before any cost, without a bench's noise (the round count sets the standard
error, about 1 / sqrt(rounds) tokens). The figures in docs/trees.md (the sampled drafter):

    .venv/bin/python scripts/tree_acceptance.py --profile h100-8b --agreements 0.6,0.8 \\
        --shapes 3,12x2,16x2,16x4 --rounds 1000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure_args import floats, names
from sim_host_cost import _Pair


def tokens_per_round(spec: str, temperature: float, shape: str, rounds: int) -> float:
    """Mean tokens committed per round; shape 'K' (a chain) or 'NxD' (a tree)."""
    pair = _Pair(spec, temperature)
    total = 0
    for _ in range(rounds):
        before = len(pair.committed)
        if "x" not in shape:
            pair.verify(pair.propose(int(shape)))
        else:
            budget, depth = (int(x) for x in shape.split("x"))
            pair.verify_tree(pair.propose_tree(budget, depth))
        total += len(pair.committed) - before
    return total / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-8b", help="emulator profile (sim:PROFILE)")
    parser.add_argument("--agreements", default="0.6,0.8")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--shapes", default="3,12x2,16x2,16x4", help="chains K and trees NxD, comma-separated")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    shapes = names(args.shapes)
    print(f"tokens per round, {args.profile}, T = {args.temperature}, {args.rounds} rounds (emulated, in-process)")
    print("| agreement | " + " | ".join(shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for agreement in floats(args.agreements):
        spec = f"sim:{args.profile},agreement={agreement},vocab_size={args.vocab}"
        cells = [f"{tokens_per_round(spec, args.temperature, s, args.rounds):.3f}" for s in shapes]
        print(f"| {agreement:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
