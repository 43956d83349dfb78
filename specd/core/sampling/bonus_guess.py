"""The draft's guess of the target's bonus token at T > 0, drawn with the target's own coins.

Bonus-match pipelining (specd.core.rounds.pipeline.BonusMatch) drafts the next
round while the target verifies this one, after a guess of the bonus token the
target will draw when every draft token is accepted; the pre-draft is used only
when the guess is right (the speculation cache's branches alike). The target
draws its bonus by the race of specd.core.sampling.bonus_race over p: a clock
per likely token, the tail as one. The guess runs the same race over q with
the *same* coins, so it is the target's token whenever the first clock to ring
is the same one for both, which is most of the time when q is close to p: at
agreement 0.95 (emulated h100-8b, T = 0.7) 0.90 of the time against 0.82 for
the inverse CDF in token-id order this replaced, where no coupling can beat
1 - TV(p, q) = 0.92 (`scripts/bonus_guess_coupling.py`; bonus_race has the table).

Exact whatever the guess: the guess only picks which prefix the pre-draft is
made for, and a pre-draft is used only for exactly the prefix the verdict
commits, whose draft tokens are the ones a fresh draft would draw (the draft's
coins are (seed, position, Role.DRAFT)). The guess token itself is never
verified as a draft token; the target's coins decide the bonus as they always do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specd.core.sampling.bonus_race import race_draw, race_draw_rows


def coupled_guess_dense(probs: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """Each row's token by the target's bonus race: probs [G, V] in token-id order (weights >= 0, not
    necessarily normalised); seeds, positions [G] int64 (the request's seed, the bonus position) -> [G] int64."""
    out = race_draw_rows(list(probs.unbind(0)), seeds.tolist(), positions.tolist())
    return torch.tensor(out, dtype=torch.int64)


def coupled_guess(ids: Tensor, weights: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """coupled_guess_dense over a sparse q: ids, weights [G, W] in any slot order (zero-weight slots are
    padding, never chosen; a row's ids with weight distinct) -> [G] int64 token ids."""
    i, w = ids.detach().cpu().numpy(), weights.detach().to("cpu", torch.float64).numpy()
    out = []
    for g in range(i.shape[0]):
        live = w[g] > 0
        out.append(race_draw(w[g][live], i[g][live], int(seeds[g]), int(positions[g])))
    return torch.tensor(out, dtype=torch.int64)
