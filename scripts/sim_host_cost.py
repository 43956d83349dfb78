#!/usr/bin/env python
"""Host-side CPU time of one speculative round on an emulated pair (time_scale 0: no modelled waiting).

What is left when the models take no time: specd's drafter (sampling, sparse q) and verifier
(processed p, rejection sampler) on this machine's CPU, in-process (no gRPC). One session, K=4,
median over the rounds. On a GPU deployment this work runs on the accelerators in well under a
millisecond; here it adds to every emulated round (docs/performance.md).

    .venv/bin/python scripts/sim_host_cost.py [--profile h100-tp2-70b] [--vocab 4096,32000,128256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import floats, ints

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import ProposeRequest, VerifyRequest
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier


def host_round_ms(spec: str, temperature: float, rounds: int) -> tuple[float, float]:
    profile = parse_sim_spec(spec + ",time_scale=0")
    verifier, drafter = Verifier(profile.runner("target")), ModelDrafter(profile.runner("draft"))
    prompt = [random.Random(1).randrange(256) for _ in range(40)]
    params = SamplingParams(temperature=temperature, seed=3)
    verifier.open("s", prompt, params)
    drafter.open("s", prompt, params)
    committed, known = list(prompt), len(prompt)
    draft_ms, verify_ms = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        p = drafter.propose(ProposeRequest("s", len(committed), known, committed[known:], 4))
        t1 = time.perf_counter()
        o = verifier.verify(VerifyRequest("s", len(committed), p))
        t2 = time.perf_counter()
        known = len(committed) + o.accepted
        committed += p.token_ids[: o.accepted] + [o.token_id]
        draft_ms.append((t1 - t0) * 1e3)
        verify_ms.append((t2 - t1) * 1e3)
    return statistics.median(draft_ms), statistics.median(verify_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-tp2-70b")
    parser.add_argument("--vocab", default="4096,32000,128256")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    print(f"host ms per K=4 round, one session, in-process, time_scale 0 ({spec}; median of {args.rounds})")
    print("| vocabulary | T | draft (4 steps) ms | verify ms | round ms |")
    print("|---|---|---|---|---|")
    for v in ints(args.vocab):
        for t in floats(args.temperatures):
            d, vf = host_round_ms(f"{spec},vocab_size={v}", t, args.rounds)
            print(f"| {v} | {t:g} | {d:.1f} | {vf:.1f} | {d + vf:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
