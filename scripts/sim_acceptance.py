#!/usr/bin/env python
"""The acceptance knob of an emulated profile: agreement -> measured per-token acceptance a (emulated).

For each agreement, `--sessions` sessions run `--rounds` K=4 rounds, batched, through specd's own
ModelDrafter and Verifier (rejection sampler included) on the profile's emulated models (time_scale 0:
no waiting), and a = accepted / (accepted + rounds with a rejection) (the bench's `a`).

    .venv/bin/python scripts/sim_acceptance.py [--profile h100-tp2-70b] [--wire-top-k 8,64]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import floats, ints

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import ProposeRequest, VerifyRequest
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier


def acceptance(spec: str, temperature: float, wire_top_k: int, sessions: int, rounds: int, k: int) -> float:
    profile = parse_sim_spec(spec + ",time_scale=0")
    verifier = Verifier(profile.runner("target"))
    drafter = ModelDrafter(profile.runner("draft"), wire_top_k=wire_top_k)
    rng = random.Random(5)
    committed = {f"s{i}": [rng.randrange(256) for _ in range(8)] for i in range(sessions)}
    known = {sid: len(c) for sid, c in committed.items()}
    for i, (sid, prompt) in enumerate(committed.items()):
        params = SamplingParams(temperature=temperature, seed=100 + i)
        verifier.open(sid, prompt, params)
        drafter.open(sid, prompt, params)
    accepted = rejections = 0
    for _ in range(rounds):
        asks = [ProposeRequest(sid, len(c), known[sid], c[known[sid] :], k) for sid, c in committed.items()]
        proposals = drafter.propose_batch(asks)
        outcomes = verifier.verify_batch(
            [VerifyRequest(sid, len(c), p) for (sid, c), p in zip(committed.items(), proposals)]  # type: ignore[arg-type]
        )
        for (sid, c), p, o in zip(committed.items(), proposals, outcomes):
            assert not isinstance(p, Exception) and not isinstance(o, Exception)
            known[sid] = len(c) + o.accepted
            c += p.token_ids[: o.accepted] + [o.token_id]
            accepted += o.accepted
            rejections += int(o.accepted < len(p))
    return accepted / (accepted + rejections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-tp2-70b", help="profile name, with overrides after commas")
    parser.add_argument("--agreements", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95,1.0")
    parser.add_argument("--temperatures", default="0,0.7,1")
    parser.add_argument("--wire-top-k", default="8,64", help="the draft's wire top-k values (8 is the service default)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    temps = floats(args.temperatures)
    tops = ints(args.wire_top_k)
    cols = [(t, w) for t in temps for w in (tops if t > 0 else tops[:1])]
    print(f"per-token acceptance a (emulated, {spec}, K={args.k}, {args.sessions} sessions x {args.rounds} rounds)")
    print("| agreement | " + " | ".join(f"T={t:g}" + (f", wire top-{w}" if t > 0 else "") for t, w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for a in floats(args.agreements):
        row = [acceptance(f"{spec},agreement={a}", t, w, args.sessions, args.rounds, args.k) for t, w in cols]
        print(f"| {a:g} | " + " | ".join(f"{x:.3f}" for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
