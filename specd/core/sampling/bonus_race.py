"""The bonus token's draw: a race of exponential clocks over the likely tokens, the rest by inverse CDF.

The target draws its bonus token from p (specd.core.sampling.rejection, the
tree rule alike). A pipelined draft guesses that token before the verdict
(bonus-match's pre-draft, the speculation cache's branches: bonus_guess), and
its pre-draft is used only when the guess is the target's token. Both draw
with the same coins, so that a q close to p gives the same token; how often
depends on how the draw turns coins into a token.

Inverse CDF in token-id order (the draw before this module) lands both on the
same token only while their cumulative sums stay aligned up to it, which any
difference in the tokens before it moves. A race of independent exponential
clocks, one per token (the Gumbel-max trick: token i rings at E_i / p_i, the
first to ring is drawn, P(i) = p_i / sum p), gives each token its own coin: the
two draws differ only where the order of the clocks that matter differs. How
often the draft's guess is the target's token (emulated h100-8b, T = 0.7, 150
contexts x 40 coins, `scripts/bonus_guess_coupling.py`): 0.82 -> 0.90 at
agreement 0.95 and 0.58 -> 0.68 at 0.8, where no coupling can beat 1 - TV(p, q),
0.92 and 0.71 (h100-tp2-70b: 0.86 -> 0.94 and 0.64 -> 0.73, against 0.95 and 0.74).

A clock per token of the vocabulary would cost a hash per token per draw. The race
runs over the **head** only, the tokens with p_i >= HEAD_SHARE of the row's mass
(at most 1 / HEAD_SHARE of them; 9-23 in the median emulated row at T = 0.7, and
2**-10 instead of 2**-14 gave 0.88 instead of 0.90 above); the tail, every other
token with mass, races as one clock of rate m_T (the sum of its masses: the first
of independent exponential clocks rings at rate their sum), and when the tail
rings first, its token is drawn within it, proportional to p, by inverse CDF in
token-id order with the bonus coin.

Exact, whatever the head: P(head token i) = p_i / m, P(the tail rings first) = m_T / m
and then P(tail token j) = p_j / m_T, with m the row's mass; the clocks (coins of
Role.BONUS_RACE per token id, Role.BONUS_TAIL for the tail) and the tail's coin
(Role.BONUS) are independent uniforms of (seed, position, role[, token]). The head
depends on p alone, never on the coins. A draft that guesses with its own q runs the
same race over its own head and tail: it may guess wrong, never bend the target's draw.

Numbers: float64 throughout; E = -log(1 - U) with U a multiple of 2**-53 in [0, 1)
(so E is finite and >= 0); the first clock on ties (lowest token id in the head,
the head before the tail).
"""

from __future__ import annotations

import math

import numpy as np

from specd.core.errors import Internal
from specd.core.sampling.sampler import Role, coin_values, token_coins

__all__ = ["HEAD_SHARE", "race_draw"]

HEAD_SHARE = 2.0**-14  # a token races on its own clock if it holds at least this share of the row's mass


def race_draw(weights: np.ndarray, ids: np.ndarray | None, seed: int, position: int) -> int:
    """The token a row's bonus draw gives: weights [n] >= 0 (not necessarily normalised) of tokens `ids`
    [n] int64 (None: ids are 0..n-1, a dense row of the vocabulary; a sparse row's ids in any order,
    distinct, zero weights never drawn) at the bonus `position` of a request with `seed`."""
    w = np.asarray(weights, dtype=np.float64)  # [n]
    tokens = np.arange(w.size, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    total = float(w.sum())
    if not (total > 0 and math.isfinite(total)):
        raise Internal("a distribution to sample from has no finite positive mass")
    head = np.flatnonzero(w >= HEAD_SHARE * total)  # [h] slots, ascending
    if ids is not None:
        head = head[np.argsort(tokens[head], kind="stable")]  # by token id: ties go to the lowest
    tail = w.copy()
    tail[head] = 0.0
    tail_mass = float(tail.sum())
    best, first = math.inf, -1
    if head.size:
        clocks = -np.log1p(-token_coins(seed, position, Role.BONUS_RACE, tokens[head])) / w[head]  # [h]
        at = int(np.argmin(clocks))
        best, first = float(clocks[at]), int(tokens[head[at]])
    if tail_mass > 0:
        [u_tail] = coin_values([seed], [[position]], Role.BONUS_TAIL)
        if -math.log1p(-u_tail) / tail_mass < best:
            order = None if ids is None else np.argsort(tokens, kind="stable")  # slots by token id
            return _tail_token(
                tail if order is None else tail[order], tokens if order is None else tokens[order], seed, position
            )
    if first < 0:
        raise Internal("a distribution to sample from has no finite positive mass")
    return first


def _tail_token(tail: np.ndarray, tokens: np.ndarray, seed: int, position: int) -> int:
    """A tail token by inverse CDF in token-id order with the bonus coin (tail, tokens [n] by token id): the
    first whose cumulative mass exceeds u * the tail's, else the last with mass (u * mass rounded up to it)."""
    cdf = np.cumsum(tail)
    [u] = coin_values([seed], [[position]], Role.BONUS)
    at = int(np.searchsorted(cdf, u * float(cdf[-1]), side="right"))
    if at >= cdf.size:
        at = cdf.size - 1 - int(np.argmax(tail[::-1] > 0))
    return int(tokens[at])
