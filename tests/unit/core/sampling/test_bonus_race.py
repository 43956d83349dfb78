"""The bonus race (specd.core.sampling.bonus_race): exact, shared by sparse and dense rows, and coupled.

Exact: the draws over many seeds follow p, head and tail alike (chi-square), and a broken race (the
tail's clock at the wrong rate) is caught by the same check. Coupled: a q close to p draws the target's
token far more often than the inverse CDF in token-id order did.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specd.core.errors import Internal
from specd.core.sampling import bonus_race, sampler
from specd.core.sampling.bonus_race import HEAD_SHARE, race_draw, race_draw_row
from specd.core.sampling.sampler import Role, coin_values, sample_from_probs
from tests.devices import DEVICE

pytestmark = pytest.mark.unit


def _row(rng: np.random.Generator, head: int, tail: int, tail_mass: float) -> np.ndarray:
    """A row of `head` likely tokens and `tail` tokens under HEAD_SHARE each, holding tail_mass, shuffled."""
    h = rng.dirichlet(np.full(head, 5.0)) * (1.0 - tail_mass)
    t = rng.dirichlet(np.full(tail, 20.0)) * tail_mass
    assert h.min() >= HEAD_SHARE and t.max() < HEAD_SHARE
    return rng.permutation(np.concatenate([h, t]))


def _draws(p: np.ndarray, seeds: range, position: int = 40) -> np.ndarray:
    return np.array([race_draw(p, None, s, position) for s in seeds])


def _pvalue(p: np.ndarray, tokens: np.ndarray, tail: np.ndarray) -> float:
    """Chi-square of the draws against p, the tail's tokens pooled into one bin (each is rare)."""
    head = ~tail
    observed = np.append(np.bincount(tokens, minlength=p.size)[head], np.isin(tokens, np.flatnonzero(tail)).sum())
    expected = np.append(p[head], p[tail].sum()) / p.sum() * tokens.size
    return float(stats.chisquare(observed, expected).pvalue)


def test_the_draws_follow_p_head_and_tail_and_a_wrong_tail_clock_is_caught(monkeypatch) -> None:
    p = _row(np.random.default_rng(3), head=6, tail=int(0.3 / HEAD_SHARE) * 4, tail_mass=0.3)
    tail = p < HEAD_SHARE * p.sum()
    tokens = _draws(p, range(8000))
    assert _pvalue(p, tokens, tail) > 1e-3
    # the tail's tokens are drawn in proportion within it too: its most likely tenth gets its share
    top_tail = np.flatnonzero(tail)[np.argsort(p[tail])[-tail.sum() // 10 :]]
    share = np.isin(tokens, top_tail).sum() / np.isin(tokens, np.flatnonzero(tail)).sum()
    assert abs(share - p[top_tail].sum() / p[tail].sum()) < 0.05
    # power: a tail clock that rings early (its coin halved) wins too often
    real = bonus_race.coin_values
    monkeypatch.setattr(
        bonus_race,
        "coin_values",
        lambda seeds, positions, role: [u / 2 for u in real(seeds, positions, role)]
        if role == Role.BONUS_TAIL
        else real(seeds, positions, role),
    )
    assert _pvalue(p, _draws(p, range(8000)), tail) < 1e-6


def test_a_sparse_row_in_any_order_draws_what_its_dense_row_draws() -> None:
    rng = np.random.default_rng(4)
    dense = np.zeros(500)
    ids = rng.choice(500, size=60, replace=False)
    dense[ids] = _row(rng, head=8, tail=52, tail_mass=52 * HEAD_SHARE / 4)
    order = rng.permutation(60)
    for seed in range(300):
        assert race_draw(dense[ids[order]], ids[order], seed, 7) == race_draw(dense, None, seed, 7)


def test_a_tensor_row_where_it_lives_draws_what_the_host_row_draws() -> None:
    """race_draw_row (the target's rows: the passes over V where the row lives) is race_draw of the same row."""
    rng = np.random.default_rng(6)
    for tail_mass in (0.0, 0.02, 0.5):
        p = _row(rng, head=12, tail=int(max(tail_mass, 0.01) / HEAD_SHARE) * 4, tail_mass=tail_mass).astype(np.float32)
        row = torch.from_numpy(p).to(DEVICE)
        want = [race_draw(p, None, s, 3) for s in range(200)]
        assert [race_draw_row(row, s, 3) for s in range(200)] == want
        assert [bonus_race._race_draw_where_it_lives(row, s, 3) for s in range(200)] == want  # the GPU's path


def test_a_row_without_a_head_is_the_inverse_cdf_with_the_bonus_coin() -> None:
    v = int(4 / HEAD_SHARE)
    p = np.full(v, 1.0 / v)  # every token under HEAD_SHARE: the tail is the whole row
    for seed in range(50):
        [u] = coin_values([seed], [[9]], Role.BONUS)
        want = int(sample_from_probs(torch.from_numpy(p)[None], torch.tensor([u], dtype=torch.float64))[0])
        assert race_draw(p, None, seed, 9) == want


def test_q_close_to_p_guesses_the_bonus_far_more_often_than_the_inverse_cdf_did() -> None:
    rng = np.random.default_rng(5)
    close = inverse = 0
    overlap = []  # 1 - TV(p, q) per context: the most any coupling of the two draws gives
    for c in range(40):
        p = _row(rng, head=20, tail=int(0.05 / HEAD_SHARE) * 4, tail_mass=0.05)
        q = p * np.exp(rng.normal(0, 0.25, p.size))  # a draft close to the target
        q /= q.sum()
        overlap.append(np.minimum(p, q).sum())
        cp, cq = np.cumsum(p), np.cumsum(q)
        for seed in range(25):
            bonus = race_draw(p, None, seed, 100 + c)
            close += race_draw(q, None, seed, 100 + c) == bonus
            [u] = coin_values([seed], [[100 + c]], Role.BONUS)  # the inverse CDF in token-id order
            inverse += np.searchsorted(cp, u * cp[-1], side="right") == np.searchsorted(cq, u * cq[-1], side="right")
    assert close / 1000 > inverse / 1000 + 0.1 and close / 1000 > np.mean(overlap) - 0.1


def test_a_row_without_mass_is_refused() -> None:
    with pytest.raises(Internal):
        race_draw(np.zeros(8), None, 1, 2)
    with pytest.raises(Internal):
        race_draw(np.array([np.nan, 1.0]), None, 1, 2)


def _batch_rows() -> list[torch.Tensor]:
    """Narrow rows of one length (race_draw_rows races them at once): peaked to flat, a tail as heavy as
    a 200-token row can hold (198 tokens just below HEAD_SHARE, 20 times), zeros unnormalised, float64."""
    g = torch.Generator().manual_seed(7)
    V = 200
    rows = [torch.softmax(torch.randn(V, generator=g) * s, -1) for s in (6.0, 3.0, 1.5, 0.5, 0.05)]
    tailed = torch.full((V,), 0.99 * HEAD_SHARE)
    tailed[[3, 150]] = (1.0 - 198 * 0.99 * HEAD_SHARE) / 2  # two head tokens; tail mass ~0.012
    rows += [tailed] * 20
    sparse = torch.zeros(V)
    sparse[[5, 6, 199]] = torch.tensor([2.0, 1.0, 1.0])
    rows.append(sparse)
    rows.append(torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2.0, -1))
    return rows


def test_rows_raced_at_once_draw_what_each_row_draws_alone() -> None:
    rows = _batch_rows()
    tail_drawn = 0
    for trial in range(40):
        seeds = [trial * 7919 + b for b in range(len(rows))]
        positions = [trial * 3 + 2 * b for b in range(len(rows))]
        want = [race_draw_row(r, s, p) for r, s, p in zip(rows, seeds, positions)]
        assert bonus_race.race_draw_rows(rows, seeds, positions) == want
        tail_drawn += sum(t not in (3, 150) for t in want[5:25])
    assert tail_drawn > 0  # the tailed rows' tail rang first in some draws: that path ran too


def test_rows_raced_at_once_refuse_a_row_without_mass() -> None:
    rows = _batch_rows()[:4] + [torch.zeros(200)]
    with pytest.raises(Internal):
        bonus_race.race_draw_rows(rows, list(range(5)), list(range(5)))


def test_token_coins_of_many_states_are_each_states_token_coins() -> None:
    seeds, positions = np.array([1, -5, 2**40, 3], dtype=np.int64), np.array([0, 7, 12, 2**33], dtype=np.int64)
    ids = np.array([0, 31_999, 5, 128_000], dtype=np.int64)
    states = sampler.coin_states(seeds, positions, Role.BONUS_RACE)
    got = sampler.token_coins_at(states, ids)
    for b in range(4):
        assert got[b] == sampler.token_coins(int(seeds[b]), int(positions[b]), Role.BONUS_RACE, ids[b : b + 1])[0]
    # and the token coins are the coins' own states mixed once more: a coin and its token coins differ
    assert not np.allclose(got, sampler.host_coins(seeds, positions[:, None], Role.BONUS_RACE)[:, 0])
