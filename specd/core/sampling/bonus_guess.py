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

import torch
from torch import Tensor

from specd.core.sampling.sampler import Role, coins, sample_from_probs


def coupled_guess_dense(probs: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """Each row's token at the target's bonus coin: probs [G, V] in token-id order (weights >= 0, not
    necessarily normalised); seeds, positions [G] int64 (the request's seed, the bonus position) -> [G] int64.

    sample_from_probs, the inverse CDF the target's bonus draw is (rejection._draw_host gives its numbers)."""
    return sample_from_probs(probs, coins(seeds, positions[:, None], Role.BONUS)[:, 0])


def coupled_guess(ids: Tensor, weights: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """coupled_guess_dense over a sparse q: ids, weights [G, W] in any slot order (zero-weight slots are
    padding, never chosen), taken in token-id order -> [G] int64 token ids."""
    order = torch.argsort(ids, dim=-1, stable=True)  # [G, W] slots in token-id order
    slot = coupled_guess_dense(weights.gather(-1, order), seeds, positions)  # [G]
    return ids.gather(-1, order).gather(-1, slot[:, None])[:, 0]
