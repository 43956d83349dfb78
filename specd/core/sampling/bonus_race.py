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
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import Internal
from specd.core.sampling.sampler import (
    Role,
    coin_states,
    coin_values,
    host_coins,
    sample_from_probs,
    token_coins,
    token_coins_at,
)

__all__ = ["HEAD_SHARE", "race_draw", "race_draw_row", "race_draw_rows"]

HEAD_SHARE = 2.0**-14  # a token races on its own clock if it holds at least this share of the row's mass

_NO_MASS = "a distribution to sample from has no finite positive mass"


def race_draw(weights: np.ndarray, ids: np.ndarray | None, seed: int, position: int) -> int:
    """The token a row's bonus draw gives: weights [n] >= 0 (not necessarily normalised) of tokens `ids`
    [n] int64 (None: ids are 0..n-1, a dense row of the vocabulary; a sparse row's ids in any order,
    distinct, zero weights never drawn) at the bonus `position` of a request with `seed`."""
    w = np.asarray(weights, dtype=np.float64)  # [n]
    total = float(w.sum())
    if not (total > 0 and math.isfinite(total)):
        raise Internal(_NO_MASS)
    head = np.flatnonzero(w >= HEAD_SHARE * total)  # [h] slots, ascending
    if ids is None:  # a dense row: slot = token id
        tokens = head
    else:
        tokens = np.asarray(ids, dtype=np.int64)
        head = head[np.argsort(tokens[head], kind="stable")]  # by token id: ties go to the lowest
        tokens = tokens[head]
    first, tail_first = _race(w[head], tokens, total, seed, position)
    if not tail_first:
        return _token(first)
    tail = w.copy()
    tail[head] = 0.0
    if ids is None:
        return _tail_token(first, torch.from_numpy(tail), None, seed, position)
    order = np.argsort(ids, kind="stable")  # slots by token id
    return _tail_token(first, torch.from_numpy(tail[order]), np.asarray(ids, dtype=np.int64)[order], seed, position)


def race_draw_row(p: Tensor, seed: int, position: int) -> int:
    """race_draw of a dense row p [V] (token ids 0..V-1) where it lives: the passes over V run there (a
    GPU row is not copied to the host), the head's few clocks on the host. The same rule; a host row
    takes race_draw, numpy's passes being the quicker on a CPU (`scripts/bonus_guess_coupling.py` times it)."""
    if p.device.type == "cpu":
        return race_draw(
            p.detach().numpy() if p.dtype in (torch.float32, torch.float64) else p.double().numpy(),
            None,
            seed,
            position,
        )
    return _race_draw_where_it_lives(p, seed, position)


# Rows of at most this many tokens, _MANY_ROWS or more of them, race at once (a narrow row alone costs
# ~50 us, nearly all of it numpy's per-call overhead). Wider rows go row by row: each row's passes then
# stay in the cache (32 rows of V = 32,000 at once took 15 ms here, one by one 6 ms).
_MANY_ROWS = 4
_NARROW = 256


def race_draw_rows(
    rows: Sequence[Tensor], seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray
) -> list[int]:
    """race_draw_row of each dense row [V] at its (seed, position): the same tokens.

    Narrow host rows of one length (float32 or float64), _MANY_ROWS or more, race at once (the
    statistical tests' thousands of 5-token rows): the totals and heads of all rows in one pass, every
    head clock in one hash; a row whose tail rings first draws its tail token alone (as race_draw
    does). Any other set of rows goes row by row."""
    B = len(rows)
    if (
        B < _MANY_ROWS
        or int(rows[0].shape[-1]) > _NARROW
        or any(r.device.type != "cpu" or r.dtype not in (torch.float32, torch.float64) for r in rows)
        or len({int(r.shape[-1]) for r in rows}) != 1
    ):
        return [race_draw_row(r, int(s), int(p)) for r, s, p in zip(rows, seeds, positions)]
    w = torch.stack([r.detach().double() for r in rows]).numpy()  # [B, V] (float32 -> float64 is exact)
    total = w.sum(-1)  # [B] each row's sum, as race_draw's (numpy sums a row alike alone or in a batch)
    if not (np.isfinite(total).all() and (total > 0).all()):
        raise Internal(_NO_MASS)
    head = w >= HEAD_SHARE * total[:, None]  # [B, V]
    r_idx, tok = np.nonzero(head)  # [H] each: row-major, so each row's head by ascending token id
    seed = np.asarray(seeds, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    u = coin_states(seed, pos, Role.BONUS_RACE)  # [B] the rows' (seed, position, role) states
    clocks = -np.log1p(-token_coins_at(u[r_idx], tok)) / w[r_idx, tok]  # [H]
    # each row's first clock to ring: lowest clock, then lowest token id (a stable sort keeps id order)
    order = np.lexsort((clocks, r_idx))  # [H] by row, then clock
    starts = np.flatnonzero(np.r_[True, r_idx[order][1:] != r_idx[order][:-1]]) if order.size else order
    first = np.full(B, -1, dtype=np.int64)
    best = np.full(B, np.inf)
    first[r_idx[order[starts]]] = tok[order[starts]]
    best[r_idx[order[starts]]] = clocks[order[starts]]
    u_tail = host_coins(seed, pos[:, None], Role.BONUS_TAIL)[:, 0]  # [B]
    out: list[int] = []
    for b in range(B):
        tail_mass = float(total[b]) - float(w[b][head[b]].sum())  # the head's sum as race_draw takes it
        f = None if first[b] < 0 else int(first[b])
        if not (tail_mass > 0 and -math.log1p(-float(u_tail[b])) / tail_mass < best[b]):
            out.append(_token(f))
            continue
        tail = w[b].copy()
        tail[head[b]] = 0.0
        out.append(_tail_token(f, torch.from_numpy(tail), None, int(seed[b]), int(pos[b])))
    return out


def _race_draw_where_it_lives(p: Tensor, seed: int, position: int) -> int:
    """race_draw_row's passes over V in torch, on p's device."""
    w = p.detach().to(torch.float64)  # [V]
    total = float(w.sum())
    if not (total > 0 and math.isfinite(total)):
        raise Internal(_NO_MASS)
    head = torch.nonzero(w >= HEAD_SHARE * total).flatten()  # [h] ascending
    first, tail_first = _race(w[head].cpu().numpy(), head.cpu().numpy(), total, seed, position)
    if not tail_first:
        return _token(first)
    tail = w.clone()
    tail[head] = 0.0
    return _tail_token(first, tail, None, seed, position)


def _race(head_w: np.ndarray, head_ids: np.ndarray, total: float, seed: int, position: int) -> tuple[int | None, bool]:
    """(the head token whose clock rings first, None without a head; whether the tail's clock, of rate
    total - the head's mass, rings before it). head_w, head_ids [h]: the head's masses and ids, by token id."""
    first, best = None, math.inf
    if head_ids.size:
        clocks = -np.log1p(-token_coins(seed, position, Role.BONUS_RACE, head_ids)) / head_w  # [h]
        at = int(np.argmin(clocks))
        first, best = int(head_ids[at]), float(clocks[at])
    tail_mass = total - float(head_w.sum())
    if not tail_mass > 0:
        return first, first is None
    [u_tail] = coin_values([seed], [[position]], Role.BONUS_TAIL)
    return first, -math.log1p(-u_tail) / tail_mass < best


def _tail_token(first: int | None, tail: Tensor, tokens: np.ndarray | None, seed: int, position: int) -> int:
    """The tail's token, drawn by the inverse CDF (sample_from_probs) in token-id order with the bonus coin:
    tail [n] the tail's masses by token id (the head's zeroed), tokens [n] their ids (None: 0..n-1);
    the head's first token instead when the tail's mass was rounding only."""
    if not float(tail.sum()) > 0:
        return _token(first)
    [u] = coin_values([seed], [[position]], Role.BONUS)
    at = int(sample_from_probs(tail[None], torch.tensor([u], dtype=torch.float64, device=tail.device))[0])
    return at if tokens is None else int(tokens[at])


def _token(first: int | None) -> int:
    if first is None:
        raise Internal(_NO_MASS)
    return first
