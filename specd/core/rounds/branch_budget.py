"""How many verdicts a speculation cache pre-drafts per round: the budget whose branches pay.

A branch call (specd.core.draft.branching) drafts the next round for up to B
verdicts of the round being verified. More branches hit more often, but every
branch is K more draft rows: on the emulated draft each sampled row is ~0.35 ms
of host work at V = 32,000, T > 0. A call that comes back after the verdict
holds the round up (the loop waits for it: the draft is busy with it either
way), and on a miss the fresh draft starts only then. With, per workload class,

    v     the verify's latency (verify out -> verdict at the coordinator)
    r(B)  the branch call's latency (call out -> reply), fitted as base + per_branch x B
    h(B)  the share of verdicts one of B branches covers
    f     a fresh draft's latency, taken as r(1): a one-branch call is a fresh draft
          (plus a ranking pass when the draft kept no rows, specd.core.draft.ranking_rows)

the next round's drafts are ready, after the verify went out, at about

    E(B) = max(v, r(B)) + (1 - h(B)) f

and the class picks the B in 1..most (the coordinator's --branch-budget) with
the least E, the smaller on ties. h(B) for every B up to the budget a round ran
with is known from that round alone: the branches come back likeliest first,
so the hit's index says which smaller budgets would have held it
(`would_hold`). Budgets above the ones run are learnt by exploring: the first
`warmup` rounds of a class alternate half the budget and a quarter of it (two
branch counts fit r's slope), then one round in `explore_every` runs twice the
choice (or half of it, at the budget). The warm-up starts below the budget
because auto (specd.core.rounds.auto) may run the cache only in its rare
explorations, whose cost it measures: warmed up on 8 and 4 branches at T = 0.7
the cache's pre-draft read 5.2-5.8 ms over a fresh draft's and auto ran
without it (emulated h100-8b, agreement 0.8: 0.15 tokens/ms against
speccache-2's 0.17-0.18); on 4 and 2, 1.4-3 ms.

Measured (emulated h100-8b, K = 2, one stream, `scripts/round_overhead.py
--pipeline spec-cache --branch-budget B`): at T = 0.7, B = 8 rounds took
21.0 ms against B = 2's 13.2 (the calls landed after the verdict, none was
staged); at T = 0, B = 4 took 9.3 ms, B = 8 9.7. Which branches are drafted
never changes a token: a hit gives the tokens a fresh draft would (the
draft's coins are (seed, position)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd.core.rounds.adaptive import Estimate, LinearCost
from specd.core.rounds.steps import MAX_BRANCH_BUDGET


@dataclass(frozen=True)
class BranchBudgetSettings:
    warmup: int = 8  # a class's first rounds alternate half the budget and a quarter of it
    explore_every: int = 16  # then one round in this many runs twice the choice (half of it at the budget)
    forget: float = 0.98  # per round: the hit counts' and the call fit's memory (~50 rounds)
    verify_horizon: float = 32.0  # the verify latency's running mean (Estimate horizon)
    held_prior: float = 2.0  # rounds a budget's hit share is shrunk towards the next smaller budget's by


def would_hold(index: int, budget: int, first_all_accepted: int | None) -> bool:
    """Would a branch call of `budget` branches have held the branch at `index` of a larger call's list?

    The list is the rule's likeliest verdicts in order, the all-accepted verdict with the best
    bonus guess always among them (select_branches: when the likeliest `budget` hold none, it
    takes the last place). So with `budget` branches: that branch always; the first `budget` if
    they hold it; else the first `budget - 1`.
    """
    if index == first_all_accepted:
        return True
    if first_all_accepted is None or first_all_accepted < budget:
        return index < budget
    return index < budget - 1


class BranchBudgetClass:
    """One workload class's measurements (greedy or sampled, draft tokens pending) and its choice."""

    def __init__(self, settings: BranchBudgetSettings) -> None:
        self.settings = settings
        self.verify = Estimate(0.0)  # ms, verify out -> verdict
        self.reply = LinearCost(forget=settings.forget)  # ms of a branch call by branches drafted
        self._seen = [0.0] * (MAX_BRANCH_BUDGET + 1)  # [b]: rounds that ran >= b branches (forgetting)
        self._held = [0.0] * (MAX_BRANCH_BUDGET + 1)  # [b]: ... whose verdict b branches would have held
        self.rounds = 0  # choices made

    def choose(self, most: int) -> int:
        """The budget of this round's branch call, 1..most."""
        self.rounds += 1
        if most <= 1:
            return most
        s = self.settings
        high = min(most, max(2, most // 2))  # two different counts, whatever the budget: the slope needs them
        low = max(1, high // 2)
        if self.rounds <= s.warmup:
            return high if self.rounds % 2 else low
        best = self.best(most)
        if best is None:  # r's slope not identified yet: keep alternating
            return high if self.rounds % 2 else low
        if self.rounds % s.explore_every == 0:
            return min(most, 2 * best) if best < most else max(1, most // 2)
        return best

    def best(self, most: int) -> int | None:
        """The budget with the least E(B) (module docstring), or None before r(B) is fitted."""
        fit = self.reply.fit()
        if fit is None or self.verify.weight <= 0:
            return None
        base, per_branch = fit
        fresh = base + per_branch
        best, best_e = 1, float("inf")
        for b in range(1, most + 1):
            e = max(self.verify.value, base + per_branch * b) + (1.0 - self.held(b)) * fresh
            if e < best_e - 1e-9:
                best, best_e = b, e
        return best

    def held(self, budget: int) -> float:
        """h(budget): the share of verdicts `budget` branches held, over the rounds that tell.

        Each budget's share is shrunk towards the one below it by `held_prior` rounds, so a
        budget run in few rounds (an exploration or two) is not taken at its luckiest; a
        budget above every one run lately takes the share below it (its extra branches
        unproven). Never less than a smaller budget's share."""
        share = 0.0
        m = self.settings.held_prior
        for b in range(1, min(budget, MAX_BRANCH_BUDGET) + 1):
            share = max(share, (self._held[b] + m * share) / (self._seen[b] + m))
        return share

    def observe(
        self,
        budget: int,
        verify_ms: float,
        reply_ms: float | None,
        branches: Sequence[tuple[int, int]],
        verdict: tuple[int, int] | None,
        pending: int,
    ) -> None:
        """One round: its budget, the two latencies (reply None: the call failed or was cut), the branches
        (accepted, token) the call returned in order, and the verdict (accepted, token; None: deferred)."""
        self.verify.update(verify_ms, horizon=self.settings.verify_horizon)
        if reply_ms is not None and branches:
            self.reply.observe(len(branches), reply_ms)
        if reply_ms is None:
            return
        index = branches.index(verdict) if verdict in branches else None
        first_all = next((i for i, (j, _) in enumerate(branches) if j == pending), None)
        f = self.settings.forget
        for b in range(1, MAX_BRANCH_BUDGET + 1):
            self._seen[b] *= f
            self._held[b] *= f
        for b in range(1, min(budget, MAX_BRANCH_BUDGET) + 1):
            self._seen[b] += 1.0
            if index is not None and would_hold(index, b, first_all):
                self._held[b] += 1.0


class BranchBudgets:
    """The service's branch-budget classes (one per RoundLoop, shared by its requests)."""

    def __init__(self, settings: BranchBudgetSettings | None = None) -> None:
        self.settings = settings or BranchBudgetSettings()
        self._classes: dict[tuple[bool, int], BranchBudgetClass] = {}

    def workload(self, greedy: bool, pending: int) -> BranchBudgetClass:
        key = (greedy, pending)
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = BranchBudgetClass(self.settings)
        return cls
