#!/usr/bin/env python
"""Depth-1 acceptance of a tree node's children at T > 0: siblings from q, or sharpened (emulated).

For contexts of an emulated pair, a node gets k children the way the model drafter draws them
(specd.core.draft.model_tree): the first from the draft's sparse q, the later ones without
replacement either from that same q or from it at half its temperature (`sharpened`); the
target's verifier walk (tree_rejection_row) then accepts one of them or none. Prints
P(a child accepted) per k and scheme. The figures in model_tree's docstring and docs/trees.md:

    .venv/bin/python scripts/tree_siblings.py --profile h100-tp2-70b,agreement=0.8 --temperature 0.7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from sim_rows import emulated_rows

from specd.core.draft.model_tree import sharpened
from specd.core.sampling.tree import DraftTree
from specd.core.sampling.tree_draft import draw_children
from specd.core.sampling.tree_rejection import tree_rejection_row


def accepted_share(p: np.ndarray, ids: torch.Tensor, w: torch.Tensor, k: int, sharp: bool, seeds: range) -> float:
    """One context: the share of `seeds` whose k children (ids/w: its sparse q [W]) get one accepted."""
    n = len(seeds)
    s = torch.tensor(list(seeds), dtype=torch.int64)
    pos = torch.zeros(n, dtype=torch.int64)
    first, q0, _ = draw_children(ids[None].expand(n, -1), w[None].expand(n, -1), 1, s, pos)
    later_ids, later_w = sharpened(ids[None], w[None]) if sharp else (ids[None], w[None])
    later_w = later_w.expand(n, -1) * (later_ids != first)  # [n, W] the first child's token removed
    rest, qr, drawn = draw_children(later_ids.expand(n, -1), later_w, k - 1, s, pos, 1)
    hits = 0
    for r in range(n):
        tokens = [int(first[r, 0])] + [int(t) for t, d in zip(rest[r], drawn[r]) if d]
        rows = [(ids.tolist(), q0[r, 0].tolist())] + [
            (later_ids[0].tolist(), qr[r, i].tolist()) for i in range(len(tokens) - 1)
        ]
        tree = DraftTree.from_wire(tokens, [-1] * len(tokens), rows, p.size)
        hits += bool(tree_rejection_row(lambda _i: p, tree, seeds[r], 0).accepted)
    return hits / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100-tp2-70b,agreement=0.8")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--contexts", type=int, default=300)
    ap.add_argument("--trials", type=int, default=10, help="seeds per context")
    ap.add_argument("--children", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    p, ids, w = emulated_rows(spec, args.contexts, args.temperature)  # [C, V]; [C, W] the chain drafter's q
    print(
        f"{spec}, T = {args.temperature:g}: P(one of k children accepted), {args.contexts} contexts x {args.trials} seeds"
    )
    print("| siblings after the first | " + " | ".join(f"k = {k}" for k in range(1, args.children + 1)) + " |")
    print("|---|" + "---|" * args.children)
    for sharp in (False, True):
        cells = []
        for k in range(1, args.children + 1):
            shares = [
                accepted_share(p[c], ids[c], w[c], k, sharp, range(c * args.trials, (c + 1) * args.trials))
                for c in range(args.contexts)
            ]
            cells.append(f"{np.mean(shares):.3f}")
        print(f"| {'from q at half the temperature' if sharp else 'from q'} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
