#!/usr/bin/env python
"""How many verdicts the speculation cache covers on an emulated profile (emulated; no waiting).

Runs `--requests` seeded requests of `--new-tokens` tokens through the in-process round loop
(specd.core.inprocess: the coordinator's loop over specd's own ModelDrafter and Verifier) on the
profile's emulated models at time_scale 0, with bonus-match pipelining and with spec-cache at each
branch budget, and prints per (T, K, strategy): the hit rate (rounds whose drafts were pre-drafted /
drafting rounds), the acceptance rate and the hits per outcome.

    .venv/bin/python scripts/speccache_hits.py [--profile h100-tp2-70b] [--temperatures 0,0.7] \\
        [--draft-lengths 2,3,4] [--budgets 1,4,8,16]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import floats, ints

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.inprocess import speculative_generate_batch
from specd.core.model.sim import parse_sim_spec
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier


def run(spec: str, temperature: float, k: int, pipeline: str, budget: int, requests: int, new_tokens: int) -> str:
    profile = parse_sim_spec(spec + ",time_scale=0")
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(20)] for _ in range(requests)]
    results = speculative_generate_batch(
        prompts,
        Verifier(profile.runner("target")),
        ModelDrafter(profile.runner("draft")),
        [SamplingParams(temperature=temperature, seed=i) for i in range(requests)],
        draft_lengths=[k] * requests,
        max_new_tokens=new_tokens,
        pipeline=pipeline,
        branch_budget=max(1, budget),
        adapt_branch_budget=False,  # the hits of exactly this budget
    )
    drafts = sum(r.stats.drafts for r in results)
    hits = sum(r.stats.pipeline_hits for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results) / max(1, sum(r.stats.draft_tokens for r in results))
    outcomes: collections.Counter[str] = collections.Counter()
    for r in results:
        outcomes.update(r.stats.pipeline_hits_by_outcome)
    by = ", ".join(f"{o} {n}" for o, n in sorted(outcomes.items()))
    return f"| {temperature:g} | {k} | {pipeline} | {budget or '-'} | {hits / drafts:.2f} | {accepted:.2f} | {by} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-tp2-70b", help="profile name, with overrides after commas")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--draft-lengths", default="2,3,4")
    parser.add_argument("--budgets", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    print("| T | K | strategy | branches | hit rate | acc. rate | hits by outcome |")
    print("|---|---|---|---|---|---|---|")
    for t in floats(args.temperatures):
        for k in ints(args.draft_lengths):
            print(run(spec, t, k, "bonus-match", 0, args.requests, args.new_tokens), flush=True)
            for b in ints(args.budgets):
                print(run(spec, t, k, "spec-cache", b, args.requests, args.new_tokens), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
