"""The draft's guess of the bonus at the target's coin: the target's own draw when q is p."""

from __future__ import annotations

import numpy as np
import torch

from specd.core.sampling.bonus_guess import coupled_guess
from specd.core.sampling.rejection import rejection_sample
from specd.core.sampling.sampler import Role, host_coins, sample_sparse

V = 40
SEEDS = np.arange(200, dtype=np.int64)


def _target_bonus(p: np.ndarray, seeds: np.ndarray, position: int) -> np.ndarray:
    """The target's bonus at `position` with no draft token: rejection_sample with K = 0, the verifier's own rule."""
    rows = torch.from_numpy(np.repeat(p[None, None], len(seeds), 0)).float()  # [B, 1, V]
    verdict = rejection_sample(
        rows,
        torch.zeros(len(seeds), 0, dtype=torch.int64),
        None,
        torch.from_numpy(seeds),
        torch.full((len(seeds),), position, dtype=torch.int64),
    )
    assert bool(verdict.is_bonus.all())
    return verdict.next_token.numpy()


def _sparse(p: np.ndarray, rng: np.random.Generator, pad: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """p's support in a shuffled slot order (as a q by mass would hold it), plus zero-weight padding."""
    support = np.flatnonzero(p > 0)
    order = rng.permutation(support)
    ids = np.concatenate([order, np.zeros(pad, dtype=np.int64)])
    weights = np.concatenate([p[order], np.zeros(pad)])
    return ids, weights


def test_with_q_equal_to_p_the_guess_is_the_targets_bonus_at_every_seed() -> None:
    rng = np.random.default_rng(0)
    for trial in range(5):
        p = rng.dirichlet(np.full(V, 0.3)).astype(np.float32).astype(np.float64)
        p[rng.choice(V, 10, replace=False)] = 0.0  # a processed p (top-k / top-p) has zeros
        ids, weights = _sparse(p, rng)
        position = 17 + trial
        got = coupled_guess(
            torch.from_numpy(np.repeat(ids[None], len(SEEDS), 0)),
            torch.from_numpy(np.repeat(weights[None], len(SEEDS), 0)).float(),
            torch.from_numpy(SEEDS),
            torch.full((len(SEEDS),), position, dtype=torch.int64),
        ).numpy()
        assert (got == _target_bonus(p, SEEDS, position)).all()
        assert (p[got] > 0).all()  # never a padding slot


def test_the_drafts_own_coin_would_agree_with_the_bonus_far_less_often() -> None:
    """The power check: the same q drawn with the draft's coin (what a guess was before) matches the bonus
    at about sum(p^2), so the equality above is the coin's doing, not a peaked p's."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(V, 0.5))
    ids, weights = _sparse(p, rng, pad=0)
    position = 9
    u = host_coins(SEEDS, np.full((len(SEEDS), 1), position, dtype=np.int64), Role.DRAFT)[:, 0]
    own = sample_sparse(
        torch.from_numpy(np.repeat(ids[None], len(SEEDS), 0)),
        torch.from_numpy(np.repeat(weights[None], len(SEEDS), 0)).float(),
        torch.from_numpy(u),
    ).numpy()
    agree = float((own == _target_bonus(p, SEEDS, position)).mean())
    assert agree < 0.5 and abs(agree - float((p * p).sum())) < 0.1, agree
