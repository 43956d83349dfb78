#!/usr/bin/env python
"""Host-side CPU time of one speculative round on an emulated pair (time_scale 0: no modelled waiting).

What is left when the models take no time: specd's drafter (sampling, sparse q) and verifier
(processed p, rejection sampler) on this machine's CPU, in-process (no gRPC). One session, K=4,
median over the rounds. On a GPU deployment this work runs on the accelerators in well under a
millisecond; here it adds to every emulated round (docs/performance.md).

The emulated model's own logits (SimLM) are computed inside each forward; in the services that
time hides in the modelled forward time. "model ms" is the wall time spent inside the runners'
forwards (SimRunner.stats.wall_ms), "specd ms" the round minus it: specd's own host work, which
issue 29 bounds at 3 ms per K=4 round at V = 32,000, T = 0.7. A second table times a speculation
cache's branch call (ModelDrafter.draft_batch with a BranchRequest: --branch-budget branches of
--branch-k drafts for the --branch-k tokens being verified), which runs beside a verify.

    .venv/bin/python scripts/sim_host_cost.py [--profile h100-tp2-70b] [--vocab 4096,32000,128256]
        [--tree-budgets 16,64 --tree-depth 4]   # also a tree round's table (docs/trees.md)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import floats, ints

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.trees import propose_trees
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import BranchRequest, ProposeRequest, TreeProposeRequest, TreeVerifyRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree
from specd.core.target.verifier import Verifier


@dataclass(frozen=True)
class RoundCost:
    """Medians over the rounds, ms."""

    draft: float  # the draft's 4 steps
    verify: float
    round: float  # draft + verify
    model: float  # inside the emulated forwards (both runners)
    specd_draft: float  # draft minus its forwards
    specd_verify: float  # verify minus its forward
    specd: float  # round minus every forward: specd's own host work


@dataclass(frozen=True)
class BranchCost:
    """Medians over the branch calls, ms."""

    call: float  # ModelDrafter.draft_batch([BranchRequest]): choose the branches, draft each
    model: float  # inside the draft's emulated forwards
    specd: float  # call minus its forwards


class _Pair:
    """An emulated draft and target at time_scale 0, one session open on both."""

    def __init__(self, spec: str, temperature: float) -> None:
        profile = parse_sim_spec(spec + ",time_scale=0")
        self.target, self.draft = profile.runner("target"), profile.runner("draft")
        self.verifier, self.drafter = Verifier(self.target), ModelDrafter(self.draft)
        prompt = [random.Random(1).randrange(256) for _ in range(40)]
        params = SamplingParams(temperature=temperature, seed=3)
        self.verifier.open("s", prompt, params)
        self.drafter.open("s", prompt, params)
        self.committed, self.known = list(prompt), len(prompt)  # known: tokens the draft's sequence agrees on

    def propose(self, k: int) -> Proposal:
        c = self.committed
        return self.drafter.propose(ProposeRequest("s", len(c), self.known, c[self.known :], k))

    def verify(self, p: Proposal, *, branched: bool = False) -> None:
        """Verify p after the committed prefix and commit the verdict.

        The draft's sequence then agrees on the committed prefix and the accepted drafts (after a
        branch call: on the committed prefix only, the part every branch shares)."""
        o = self.verifier.verify(VerifyRequest("s", len(self.committed), p))
        self.known = len(self.committed) + (0 if branched else o.accepted)
        self.committed += p.token_ids[: o.accepted] + [o.token_id]

    def propose_tree(self, budget: int, depth: int) -> DraftTree:
        """The model drafter's tree of `budget` nodes, `depth` levels, after the committed prefix."""
        c = self.committed
        [tree] = propose_trees(
            self.drafter, [TreeProposeRequest("s", len(c), self.known, c[self.known :], budget, depth)]
        )
        if isinstance(tree, Exception):
            raise tree
        return tree

    def verify_tree(self, tree: DraftTree) -> None:
        """Verify the tree after the committed prefix and commit its path and one more token."""
        [o] = self.verifier.verify_tree_batch([TreeVerifyRequest("s", len(self.committed), tree)])
        if isinstance(o, Exception):
            raise o
        self.known = len(self.committed)  # the tree's nodes never enter the draft's sequence
        self.committed = self.committed + list(o.tokens) + [o.token_id]


def _medians(cols: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(xs) for name, xs in cols.items()}


def _add_round(cols: dict[str, list[float]], d_ms: float, v_ms: float, d_model: float, v_model: float) -> None:
    """One round's RoundCost columns, in field order, from its draft and verify walls and their model times."""
    row = (d_ms, v_ms, d_ms + v_ms, d_model + v_model, d_ms - d_model, v_ms - v_model)
    for name, x in zip(cols, (*row, row[2] - row[3])):
        cols[name].append(x)


def host_round_ms(spec: str, temperature: float, rounds: int) -> RoundCost:
    """A K=4 round (propose, verify) per iteration, timed around each call and inside the forwards."""
    s = _Pair(spec, temperature)
    cols: dict[str, list[float]] = {name: [] for name in RoundCost.__dataclass_fields__}
    for _ in range(rounds):
        d0, t0 = s.draft.snapshot().wall_ms, time.perf_counter()
        p = s.propose(4)
        v0, t1 = s.target.snapshot().wall_ms, time.perf_counter()
        s.verify(p)
        t2 = time.perf_counter()
        d_model, v_model = s.draft.snapshot().wall_ms - d0, s.target.snapshot().wall_ms - v0
        _add_round(cols, (t1 - t0) * 1e3, (t2 - t1) * 1e3, d_model, v_model)
    return RoundCost(**_medians(cols))


def host_branch_ms(spec: str, temperature: float, rounds: int, k: int, budget: int) -> BranchCost:
    """A speculation cache's branch call per round: `budget` branches of k drafts for the k being verified."""
    s = _Pair(spec, temperature)
    cols: dict[str, list[float]] = {name: [] for name in BranchCost.__dataclass_fields__}
    for _ in range(rounds):
        p = s.propose(k)
        prefix = s.committed + list(p.token_ids)
        request = BranchRequest("s", len(prefix), len(prefix), [], k, k, budget, (0.8,) * k)
        d0, t0 = s.draft.snapshot().wall_ms, time.perf_counter()
        [branches] = s.drafter.draft_batch([request])
        call = (time.perf_counter() - t0) * 1e3
        model = s.draft.snapshot().wall_ms - d0
        if isinstance(branches, Exception):
            raise branches
        for name, x in zip(cols, (call, model, call - model)):
            cols[name].append(x)
        s.verify(p, branched=True)
    return BranchCost(**_medians(cols))


def host_tree_ms(spec: str, temperature: float, rounds: int, budget: int, depth: int) -> RoundCost:
    """A tree round per iteration (the model drafter's tree of `budget` nodes, `depth` levels, then
    its verify), timed as host_round_ms times a chain round."""
    s = _Pair(spec, temperature)
    cols: dict[str, list[float]] = {name: [] for name in RoundCost.__dataclass_fields__}
    for _ in range(rounds):
        d0, t0 = s.draft.snapshot().wall_ms, time.perf_counter()
        tree = s.propose_tree(budget, depth)
        v0, t1 = s.target.snapshot().wall_ms, time.perf_counter()
        s.verify_tree(tree)
        t2 = time.perf_counter()
        d_model, v_model = s.draft.snapshot().wall_ms - d0, s.target.snapshot().wall_ms - v0
        _add_round(cols, (t1 - t0) * 1e3, (t2 - t1) * 1e3, d_model, v_model)
    return RoundCost(**_medians(cols))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-tp2-70b")
    parser.add_argument("--vocab", default="4096,32000,128256")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--branch-budget", type=int, default=8, help="branches per branch call (0: no branch table)")
    parser.add_argument("--branch-k", type=int, default=3, help="pending tokens and drafts per branch")
    parser.add_argument("--tree-budgets", default="", help="node budgets of a tree-round table (e.g. 16,64)")
    parser.add_argument("--tree-depth", type=int, default=4, help="levels of those trees")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = args.profile if args.profile.startswith("sim:") else "sim:" + args.profile
    print(f"host ms per K=4 round, one session, in-process, time_scale 0 ({spec}; median of {args.rounds})")
    print(
        "| vocabulary | T | draft (4 steps) ms | verify ms | round ms "
        "| model ms | specd draft ms | specd verify ms | specd round ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v in ints(args.vocab):
        for t in floats(args.temperatures):
            c = host_round_ms(f"{spec},vocab_size={v}", t, args.rounds)
            print(
                f"| {v} | {t:g} | {c.draft:.1f} | {c.verify:.1f} | {c.round:.1f} "
                f"| {c.model:.1f} | {c.specd_draft:.2f} | {c.specd_verify:.2f} | {c.specd:.2f} |",
                flush=True,
            )
    if args.tree_budgets:
        print(f"\nhost ms per tree round (the model drafter's tree, {args.tree_depth} levels; median of {args.rounds})")
        print(
            "| vocabulary | T | nodes | draft ms | verify ms | round ms | model ms | specd draft ms | specd verify ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for v in ints(args.vocab):
            for t in floats(args.temperatures):
                for n in ints(args.tree_budgets):
                    c = host_tree_ms(f"{spec},vocab_size={v}", t, args.rounds, n, args.tree_depth)
                    print(
                        f"| {v} | {t:g} | {n} | {c.draft:.1f} | {c.verify:.1f} | {c.round:.1f} "
                        f"| {c.model:.1f} | {c.specd_draft:.2f} | {c.specd_verify:.2f} |",
                        flush=True,
                    )
    if args.branch_budget < 1:
        return 0
    print(f"\nhost ms per branch call (budget {args.branch_budget}, K={args.branch_k}; median of {args.rounds})")
    print("| vocabulary | T | branch call ms | model ms | specd ms |")
    print("|---|---|---|---|---|")
    for v in ints(args.vocab):
        for t in floats(args.temperatures):
            b = host_branch_ms(f"{spec},vocab_size={v}", t, args.rounds, args.branch_k, args.branch_budget)
            print(f"| {v} | {t:g} | {b.call:.1f} | {b.model:.1f} | {b.specd:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
