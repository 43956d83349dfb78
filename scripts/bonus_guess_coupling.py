#!/usr/bin/env python
"""How often a draft's guess of the target's bonus token is right at T > 0, by how it is drawn (emulated).

For contexts of an emulated pair, the target's bonus is drawn as the verifier draws it (the race of
specd.core.sampling.bonus_race over p at the request's coins). The draft's guess is
- "own coin": drawn from its sparse q with its own coin (bonus-match's guess before the coupling):
  right with probability sum p q;
- "top token": q's likeliest token (the speculation cache's first bonus branch): right w.p. p(top);
- "target's coins": specd.core.sampling.bonus_guess.coupled_guess, the same race over the sparse q
  with the target's coins;
- "1 - TV": sum min(p, q), the most any coupling of the two draws can give.
Then the host time of one bonus draw over a float32 target row of these contexts: the race
(specd.core.sampling.bonus_race.race_draw_row) against the inverse CDF it replaced
(specd.core.sampling.rejection._draw_host of the row, as the recovered tokens are still drawn).
Prints P(right) per profile and agreement, averaged over contexts and coins. The figures in
specd/core/sampling/bonus_guess.py and specd/core/draft/branching.py:

    .venv/bin/python scripts/bonus_guess_coupling.py --profiles h100-8b,h100-tp2-70b --agreements 0.6,0.8,0.95
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from sim_rows import emulated_rows

from specd.core.sampling.bonus_guess import coupled_guess, coupled_guess_dense
from specd.core.sampling.bonus_race import race_draw_row
from specd.core.sampling.rejection import _draw_host


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="h100-8b,h100-tp2-70b")
    ap.add_argument("--agreements", default="0.6,0.8,0.95")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--contexts", type=int, default=300)
    ap.add_argument("--coins", type=int, default=100, help="seeds per context")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"T = {args.temperature:g}: P(the draft's guess is the target's bonus), {args.contexts} contexts x {args.coins} coins"
    )
    print("| profile | agreement | own coin | top token | target's coins | 1 - TV |")
    print("|---|---|---|---|---|---|")
    seeds = torch.arange(args.coins, dtype=torch.int64)
    for profile_name in args.profiles.split(","):
        for agreement in (float(a) for a in args.agreements.split(",")):
            spec = f"sim:{profile_name},agreement={agreement}"
            p, ids, weights = emulated_rows(spec, args.contexts, args.temperature)  # [C, V]; [C, W]
            own, top, coupled, best = [], [], [], []
            for c in range(args.contexts):
                w = weights[c].double().numpy()
                live = w > 0
                q_c = np.zeros(p.shape[1])
                np.add.at(q_c, ids[c].numpy()[live], w[live] / w.sum())
                own.append(float((p[c] * q_c).sum()))
                top.append(float(p[c, int(q_c.argmax())]))
                best.append(float(np.minimum(p[c] / p[c].sum(), q_c).sum()))
                position = torch.full((args.coins,), 100 + c, dtype=torch.int64)
                # the target's bonus is the race over p at the same coins (rejection's draw)
                bonus = coupled_guess_dense(torch.from_numpy(p[c]).expand(args.coins, -1), seeds, position)
                rows = ids[c].expand(args.coins, -1), weights[c].expand(args.coins, -1)
                coupled.append(float((coupled_guess(*rows, seeds, position) == bonus).float().mean()))
            print(
                f"| {profile_name} | {agreement:g} | {np.mean(own):.3f} | {np.mean(top):.3f} | {np.mean(coupled):.3f} "
                f"| {np.mean(best):.3f} |",
                flush=True,
            )
            last = p
    rows_f32 = [torch.from_numpy(row.astype(np.float32)) for row in last]  # the last cell's target rows
    race = _ms_per_draw(lambda c: race_draw_row(rows_f32[c], c, 100), len(rows_f32))
    none = np.zeros(0, dtype=np.int64)
    inverse = _ms_per_draw(lambda c: _draw_host(rows_f32[c].numpy(), False, none, np.zeros(0), 0.5), len(rows_f32))
    print(f"\nHost ms per bonus draw (V = {last.shape[1]}): the race {race:.3f}, the inverse CDF {inverse:.3f}")
    return 0


def _ms_per_draw(draw: Callable[[int], object], n: int, repeats: int = 5) -> float:
    """Mean wall ms of draw(c) over c < n, `repeats` times, after one warm call."""
    draw(0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for c in range(n):
            draw(c)
    return (time.perf_counter() - t0) * 1e3 / (repeats * n)


if __name__ == "__main__":
    raise SystemExit(main())
