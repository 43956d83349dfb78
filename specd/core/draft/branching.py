"""A speculation cache's branches: which verdicts of the round being verified to pre-draft for.

While the target verifies K pending draft tokens d_0..d_{K-1}, its verdict
is one of

    (j, t), j < K:  d_0..d_{j-1} accepted, d_j rejected, t recovered
    (K, t):         all accepted, t the bonus token

and the next round's drafts depend on it only through the prefix it
commits, committed + d_0..d_{j-1} + t. A *branch* is one such (j, t) with
the draft tokens for that prefix; the loop uses a branch only when the
verdict is exactly its (j, t) (specd.core.rounds.loop), so choosing branches is a
matter of speed, never of exactness.

The rule (SSD / Saguaro's, with a geometric-style acceptance model): cover the
`budget` most likely verdicts,

    P(j, t) = P(exactly j accepted) * P(t | j)
    P(exactly j accepted) = a_0 ... a_{j-1} (1 - a_j),   P(K) = a_0 ... a_{K-1}
    P(t | j < K) = q_j(t) / (1 - q_j(d_j)),  t != d_j    (the draft's own alternatives to d_j)
    P(t | K)     = q_K(t)                                 (the draft's guess of the bonus)

with a_i the acceptance of pending position i given the ones before it were
accepted and q_j the draft's distribution at position j; and always the
all-accepted verdict with the draft's best bonus guess (what bonus-match
pre-drafts), even when the product ranks it lower: acceptance runs in
streaks (contexts where draft and target agree), so P(all accepted) is more
than the product of the a_i, and with one branch bonus-match's choice hits
more often than the product's (docs/results/code-choices.md). Why these: the
coordinator knows how often each position is accepted
(`specd.core.rounds.adaptive.PositionAcceptance`:
this request's verdicts, shrunk towards a prior), the draft knows what it
would say instead, and their product is the probability of the verdict under
the model "the target accepts position i with probability a_i and, when it
rejects, says what the draft would say next".

- T > 0: q is the request's processed distribution, a the measured rates.
  The bonus is drawn from p, which q approximates; the recovered token from
  normalise(max(0, p - q)), which q's alternatives approximate less well.
- T = 0: the verdict is about the target's argmax, and the draft's softmax
  is not calibrated for that (it gives its top token less probability than
  how often that token is the target's argmax; docs/results/code-choices.md). So q is
  temperature-scaled (`calibrated_greedy`): softmax(g * logits) with the g
  whose confidence in the draft's own pending tokens averages the measured
  acceptance, and a_i = sqrt(measured a_i x calibrated q_i(d_i)), which
  keeps the per-position rates and adds what the draft knows about this
  round (a confident token is accepted more often); it covers more of the
  verdicts than the uncalibrated softmax (docs/results/code-choices.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specd.core.rounds.steps import Branch, Branches
from specd.core.sampling.block_topk import block_topk
from specd.core.sampling.greedy import scaled_logsumexp
from specd.core.sampling.proposal import Proposal


@dataclass(frozen=True)
class BranchChoice:
    accepted: int
    token_id: int
    probability: float  # the rule's estimate of P(the verdict is exactly this)


@dataclass(frozen=True)
class Ranking:
    """The draft's likeliest tokens at the K pending positions and the bonus position (row K)."""

    ids: Tensor  # [K+1, W] int64 token ids, likeliest first
    probs: Tensor  # [K+1, W] float32 their probabilities
    own: tuple[float, ...]  # K: each pending token's probability at its own row (it need not be among ids)


def top_ranking(probs: Tensor, pending: Sequence[int], width: int) -> Ranking:
    """[K+1, V] distributions -> their `width` likeliest tokens per row, and the pending tokens' own mass."""
    k = len(pending)
    assert probs.dim() == 2 and probs.shape[0] == k + 1, f"probs must be [K+1, V] for K={k}, got {tuple(probs.shape)}"
    top_p, top_i = block_topk(probs.float(), min(width, int(probs.shape[1])))  # [K+1, W] each
    own = probs[torch.arange(k), torch.tensor(list(pending), dtype=torch.int64)].tolist() if k else []
    return Ranking(top_i, top_p, tuple(float(x) for x in own))


def outcome_probabilities(acceptance: Sequence[float]) -> list[float]:
    """P(exactly j of the K pending tokens accepted) for j = 0..K (K + 1 numbers summing to 1)."""
    out, reach = [], 1.0
    for a in acceptance:
        a = min(1.0, max(0.0, float(a)))
        out.append(reach * (1.0 - a))
        reach *= a
    out.append(reach)
    return out


def select_branches(
    ranking: Ranking,
    pending: Sequence[int],
    acceptance: Sequence[float],
    budget: int,
    bonus_guess: int | None = None,
) -> list[BranchChoice]:
    """The `budget` likeliest verdicts (module docstring), likeliest first; ties: deeper, then lower id.

    ranking: per row j, the draft's likeliest tokens after the first j pending
    tokens (row K: after all of them, the bonus position); acceptance: K
    per-position conditional acceptance rates; bonus_guess: at T > 0, the draft's
    guess of the bonus at the target's coin (specd.core.sampling.bonus_guess), rated as
    the likeliest bonus (P(t | K) of the draft's top token, ranked before it) and the
    all-accepted verdict that is always covered. Where the draft agrees with the target
    it is the bonus more often than the draft's top token: emulated h100-8b, T = 0.7,
    0.82 against 0.62 of the time at agreement 0.95, 0.58 against 0.58 at 0.8; at 0.6,
    where pipelining gains little, 0.28 against 0.39 (scripts/bonus_guess_coupling.py).
    Through the services (round_overhead.py, speccache-2, three alternated pairs):
    194 -> 206 tokens/s at agreement 0.95, 155 -> 151 at 0.8 on h100-8b and 69 -> 70 on
    h100-tp2-70b (within those runs' spread).
    """
    k = len(pending)
    assert ranking.ids.shape[0] == k + 1 and len(ranking.own) == k, f"need a ranking of K+1 rows for K={k}"
    assert len(acceptance) == k, f"need one acceptance rate per pending token ({k}), got {len(acceptance)}"
    if budget < 1:
        return []
    reach = outcome_probabilities(acceptance)
    ids, probs = ranking.ids.tolist(), ranking.probs.tolist()
    if bonus_guess is not None and probs[k]:  # the coupled guess first in row K, at its top token's mass
        top = max(probs[k])
        row = [(p, t) for p, t in zip(probs[k], ids[k]) if t != bonus_guess]
        probs[k], ids[k] = [top, *(p for p, _ in row)], [bonus_guess, *(t for _, t in row)]
    candidates: list[tuple[float, int, int, int]] = []  # (probability, accepted, not the coupled guess, token)
    for j in range(k + 1):
        if reach[j] <= 0.0:
            continue
        rejected = pending[j] if j < k else None
        rest = 1.0 - ranking.own[j] if j < k else 1.0  # mass of the alternatives to the rejected token
        if rest <= 1e-12:
            continue
        for p, t in zip(probs[j], ids[j]):
            if t != rejected and p > 0.0:
                candidates.append((reach[j] * p / rest, j, int(j < k or t != bonus_guess), int(t)))
    candidates.sort(key=lambda c: (-c[0], -c[1], c[2], c[3]))
    chosen = candidates[:budget]
    if reach[k] > 0.0 and not any(j == k for _, j, _, _ in chosen):
        # Always the all-accepted verdict with the best bonus guess (bonus-match's one pre-draft):
        # acceptance runs in streaks, so P(all accepted) exceeds the product the rule uses.
        best = next((c for c in candidates if c[1] == k), None)
        if best is not None:
            chosen = [*chosen[: budget - 1], best]
    return [BranchChoice(j, t, p) for p, j, _, t in chosen]


_FIT_WIDTH = 64  # logits per row the calibration's fit normalises over


def calibrated_greedy(
    logits: Tensor, pending: Sequence[int], acceptance: Sequence[float], width: int
) -> tuple[Ranking, tuple[float, ...]] | None:
    """A greedy request's ranking: the temperature-scaled draft distribution, and per-position acceptance.

    logits: [K+1, V] the draft's logits at the pending positions and the one
    after them. The ranking is softmax(g * logits) (the `width` likeliest per
    row) for the smallest g on a grid over [1/4, 16] at which the mean of the
    pending tokens' own probabilities reaches the mean measured acceptance (the
    fit normalises over each row's 64 largest logits, the result over the whole
    row); a_i = sqrt(acceptance_i x own_i). None: a row cannot be sampled (a NaN or +inf, or no finite
    logit: the top-k's first value is not finite, as the top-k ranks NaN first).
    """
    k = len(pending)
    assert logits.dim() == 2 and logits.shape[0] == k + 1 and k >= 1, f"logits must be [K+1, V], K={k}"
    x = logits.float()
    top, ids = block_topk(x, min(max(width, _FIT_WIDTH), int(x.shape[1])))  # [K+1, W'] each
    if not bool(top[:, 0].isfinite().all()):
        return None
    mine = x[torch.arange(k), torch.tensor(list(pending), dtype=torch.int64)]  # [K]
    grid = torch.logspace(-2.0, 4.0, 49, base=2.0)  # [G] inverse temperatures 1/4 .. 16, steps of 2^(1/8)
    g_top = grid[:, None, None] * top[None, :k]  # [G, K, W']
    conf = torch.exp(grid[:, None] * mine[None] - torch.logsumexp(g_top, dim=-1)).mean(-1)  # [G]
    reached = (conf >= sum(acceptance) / k).nonzero()
    g = float(grid[int(reached[0, 0])] if len(reached) else grid[-1])
    lse = scaled_logsumexp(x, top[:, 0], g)  # [K+1] over the whole rows (a large g's tail is 100+ below the max)
    probs = torch.exp(g * top[:, :width] - lse[:, None])  # [K+1, W]
    own = torch.exp(g * mine - lse[:k]).tolist()
    ranking = Ranking(ids[:, :width], probs, tuple(own))
    return ranking, tuple(math.sqrt(max(0.0, a) * c) for a, c in zip(acceptance, own))


def bonus_guess(pending: int, proposal: Proposal) -> Branches:
    """The branch of a drafter with no distribution (n-gram, suffix): the all-accepted verdict only.

    `proposal` was drafted after the whole prefix (every pending token accepted);
    its first token is the guess of the bonus, the rest the next round's drafts.
    """
    if len(proposal) < 2:
        return Branches((), proposal.compute_ms, proposal.phases)
    rest = proposal.window(1, compute_ms=proposal.compute_ms)
    return Branches((Branch(pending, proposal.token_ids[0], rest),), proposal.compute_ms, proposal.phases)
