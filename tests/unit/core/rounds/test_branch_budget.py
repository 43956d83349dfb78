"""The speculation cache's adapted branch budget (specd.core.rounds.branch_budget): which smaller budgets
would have held a verdict, the budget chosen from the measured latencies and hits, and the loop with it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specd.core.draft.branching import Ranking, select_branches
from specd.core.rounds.branch_budget import BranchBudgetClass, BranchBudgets, BranchBudgetSettings, would_hold
from specd.core.rounds.steps import MAX_BRANCH_BUDGET
from tests.unit.core.rounds.test_loop import expected
from tests.unit.core.rounds.test_loop_spec_cache import spec_cache_run


def _ranking(rng: random.Random, k: int, vocab: int) -> tuple[Ranking, list[int]]:
    probs = torch.tensor([[rng.random() ** 3 for _ in range(vocab)] for _ in range(k + 1)])
    probs = probs / probs.sum(-1, keepdim=True)
    top_p, top_i = torch.sort(probs, dim=-1, descending=True, stable=True)
    pending = [rng.randrange(vocab) for _ in range(k)]
    own = tuple(float(probs[j, t]) for j, t in enumerate(pending))
    return Ranking(top_i, top_p, own), pending


@pytest.mark.parametrize("seed", range(40))
def test_would_hold_names_exactly_what_a_smaller_branch_call_chooses(seed: int) -> None:
    """For every budget below a call's, the branches `would_hold` keeps of its list are select_branches' own."""
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    ranking, pending = _ranking(rng, k, vocab=rng.randint(3, 12))
    acceptance = [rng.uniform(0.05, 0.95) for _ in range(k)]
    most = rng.randint(2, MAX_BRANCH_BUDGET)
    listed = [(c.accepted, c.token_id) for c in select_branches(ranking, pending, acceptance, most)]
    first_all = next((i for i, (j, _) in enumerate(listed) if j == k), None)
    for budget in range(1, len(listed) + 1):
        smaller = {(c.accepted, c.token_id) for c in select_branches(ranking, pending, acceptance, budget)}
        held = {b for i, b in enumerate(listed) if would_hold(i, budget, first_all)}
        assert held == smaller, (budget, listed)


def _simulate(
    cls: BranchBudgetClass, most: int, verify_ms: float, base: float, per_branch: float, rounds: int
) -> list[int]:
    """Rounds of a class whose verdict is the branch at a geometric rank (the all-accepted one first)."""
    rng = random.Random(7)
    chosen = []
    for _ in range(rounds):
        budget = cls.choose(most)
        chosen.append(budget)
        branches = [(2, 100)] + [(rank % 2, rank) for rank in range(1, budget)]
        rank = min(int(rng.expovariate(0.35)), 30)  # P(rank r) falls ~30% per rank: more branches hold more
        verdict = (2, 100) if rank == 0 else (rank % 2, rank)
        reply = base + per_branch * budget + rng.uniform(-0.3, 0.3)
        cls.observe(budget, verify_ms + rng.uniform(-0.3, 0.3), reply, branches, verdict, pending=2)
    return chosen


def _true_e(b: int, verify_ms: float, base: float, per_branch: float) -> float:
    """E(B) under the simulated curve: P(rank < B) held, r(B) = base + per_branch B."""
    held = 1.0 - math.exp(-0.35 * b)
    return max(verify_ms, base + per_branch * b) + (1.0 - held) * (base + per_branch)


@pytest.mark.parametrize(
    ("base", "per_branch", "optimum"),
    [
        (6.8, 1.15, 3),  # T = 0.7 on the emulated 8B pair: a branch costs ~1 ms of host work
        (4.0, 1.0, 5),  # cheaper branches: as many as land with the verdict
        (2.0, 1.5, 4),
        (3.0, 0.1, 8),  # branches nearly free (a GPU draft): every one the budget allows
    ],
)
def test_the_budget_follows_what_a_branch_costs_against_the_verify(
    base: float, per_branch: float, optimum: int
) -> None:
    assert min(range(1, 9), key=lambda b: _true_e(b, 9.0, base, per_branch)) == optimum
    cls = BranchBudgetClass(BranchBudgetSettings())
    chosen = _simulate(cls, 8, 9.0, base, per_branch, rounds=400)
    assert all(1 <= b <= 8 for b in chosen)
    settled = chosen[-160:]  # the choice and its explorations
    mean_e = sum(_true_e(b, 9.0, base, per_branch) for b in settled) / len(settled)
    assert mean_e <= 1.03 * _true_e(optimum, 9.0, base, per_branch)
    fixed_most = _true_e(8, 9.0, base, per_branch)  # what a fixed budget of 8 costs
    if optimum < 8:
        assert mean_e < fixed_most


def test_a_class_warms_up_on_two_budgets_then_explores_around_its_choice() -> None:
    cls = BranchBudgetClass(BranchBudgetSettings(warmup=8, explore_every=16))
    chosen = _simulate(cls, 8, 9.0, 6.8, 1.15, rounds=63)
    assert chosen[:8] == [4, 2] * 4  # two branch counts identify the call's slope, below the budget
    best = cls.best(8)
    assert best is not None and best < 8
    assert cls.choose(8) == min(8, 2 * best)  # round 64: an exploration above the choice
    assert cls.choose(1) == 1  # a budget of one is no choice
    for most, pair in ((2, [2, 1]), (3, [2, 1]), (4, [2, 1]), (16, [8, 4])):  # two counts at every budget
        small = BranchBudgetClass(BranchBudgetSettings(warmup=4))
        assert [small.choose(most) for _ in range(4)] == pair * 2


def test_classes_are_per_sampling_and_pending_tokens() -> None:
    budgets = BranchBudgets()
    assert budgets.workload(True, 2) is budgets.workload(True, 2)
    assert budgets.workload(True, 2) is not budgets.workload(False, 2)
    assert budgets.workload(False, 2) is not budgets.workload(False, 3)


def test_the_loop_with_adapted_budgets_emits_the_same_tokens_and_hits_only_what_it_drafted() -> None:
    r, records, target, draft = spec_cache_run(160, 8, adapt_branch_budget=True)
    assert r.generation.generated == expected(160) and target.violations == [] and draft.violations == []
    launched = [rec for rec in records if rec.pipeline_launched]
    assert {rec.pipeline_launched for rec in launched} >= {4, 2}  # the warm-up's two budgets
    assert all(1 <= rec.pipeline_launched <= 8 for rec in launched)
    for rec, result in zip(launched, draft.branch_results):
        assert len(result) <= rec.pipeline_launched
        covered = {(b.accepted, b.token_id) for b in result.branches}
        nxt = records[rec.index + 1] if rec.index + 1 < len(records) else None
        if nxt is not None and nxt.draft_length:
            assert (nxt.pipeline_hit is not None) == ((rec.accepted, rec.token_id) in covered)
