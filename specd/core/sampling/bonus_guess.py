"""The draft's guess of the target's bonus token at T > 0, drawn with the target's own coin.

Bonus-match pipelining (specd.core.rounds.pipeline.BonusMatch) drafts the next
round while the target verifies this one, after a guess of the bonus token the
target will draw when every draft token is accepted; the pre-draft is used only
when the guess is right. The target draws its bonus by inverse CDF over p in
token-id order with the coin (seed, position, Role.BONUS)
(specd.core.sampling.rejection). A guess drawn from q with the draft's own coin
is independent of that draw: it is right with probability sum_t p(t) q(t). Drawn
by inverse CDF over q in the same order with the *same* coin, it is the
target's token whenever u falls in the same token's interval of both CDFs, which
is most of the time when q is close to p. Emulated, T = 0.7, 300 contexts x 100
coins (`scripts/bonus_guess_coupling.py`): right 0.41 -> 0.58 of the time at
agreement 0.8 on h100-8b, 0.49 -> 0.82 at 0.95 and 0.24 -> 0.28 at 0.6 (h100-tp2-70b:
0.45 -> 0.64, 0.53 -> 0.86, 0.25 -> 0.32). The draft's likeliest token would be right
0.58, 0.62 and 0.39 of the time: better where the draft is poor, but the draft does
not know the acceptance when it is asked to propose.

Exact whatever the guess: the guess only picks which prefix the pre-draft is
made for, and a pre-draft is used only for exactly the prefix the verdict
commits, whose draft tokens are the ones a fresh draft would draw (the draft's
coins are (seed, position, Role.DRAFT)). The guess token itself is never
verified as a draft token; the target's bonus coin decides the bonus as it
always does.
"""

from __future__ import annotations

import numpy as np

from specd.core.sampling.sampler import Role, host_coins


def coupled_guess(ids: np.ndarray, weights: np.ndarray, seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each row's token at the target's bonus coin, by inverse CDF over its sparse q in token-id order.

    ids, weights: [G, W] a sparse q per row (int64 ids, weights >= 0; zero-weight slots are padding)
    seeds, positions: [G] int64, the request's seed and the bonus position
    returns: [G] int64 token ids (each with weight > 0 in its row)

    The arithmetic is the target's bonus draw (rejection._draw_host): float64 weights summed left
    to right in id order, the first token whose cumulative sum exceeds u * total, the last token
    with weight if u * total rounds up to the total.
    """
    assert ids.shape == weights.shape and ids.ndim == 2, f"ids and weights must be [G, W], got {ids.shape}"
    u = host_coins(seeds.astype(np.int64), positions.astype(np.int64)[:, None], Role.BONUS)[:, 0]  # [G]
    order = np.argsort(ids, axis=-1, kind="stable")  # [G, W] slots in token-id order
    sorted_ids = np.take_along_axis(ids, order, -1)
    w = np.take_along_axis(weights.astype(np.float64), order, -1)  # [G, W]
    cdf = np.cumsum(w, -1)  # [G, W]
    out = np.empty(ids.shape[0], dtype=np.int64)
    for g in range(ids.shape[0]):
        slot = int(np.searchsorted(cdf[g], u[g] * cdf[g, -1], side="right"))
        if slot >= ids.shape[1]:  # u * total rounded up to the total: the last token with weight
            slot = int(np.flatnonzero(w[g] > 0)[-1])
        out[g] = sorted_ids[g, slot]
    return out


def coupled_guess_dense(probs: np.ndarray, seed: int, position: int) -> int:
    """coupled_guess for one dense row probs [V] (token id = index): the speculation cache's bonus guess."""
    u = float(host_coins(np.array([seed], np.int64), np.array([[position]], np.int64), Role.BONUS)[0, 0])
    cdf = np.cumsum(probs.astype(np.float64))  # [V]
    slot = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if slot >= cdf.size:  # u * total rounded up to the total: the last token with mass
        slot = int(np.flatnonzero(probs > 0)[-1])
    return slot
