"""Statistics and the theory the bench compares against: percentiles, per-token acceptance a, S(K)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def expected_tokens_per_round(alpha: float, k: float) -> float:
    """Leviathan et al.: E[tokens per round] = (1 - a^(K+1)) / (1 - a) for per-token acceptance a."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: float, c: float) -> float:
    """S(K) = (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1.0)


def mixed_speedup(alpha: float, k: float, c: float, drafting_rounds: int, rounds: int) -> float:
    """Expected speed-up when only some rounds draft (K = their mean): tokens / cost, in target-forward units.

    A drafting round yields (1 - a^(K+1)) / (1 - a) tokens for K c + 1; any other
    round yields 1 token for 1. Equals S(K) when every round drafts.
    """
    plain = max(0, rounds - drafting_rounds)
    tokens = drafting_rounds * expected_tokens_per_round(alpha, k) + plain
    return tokens / (drafting_rounds * (k * c + 1.0) + plain)


def alpha_from_rounds(drafted: Sequence[int], accepted: Sequence[int]) -> float | None:
    """Per-token acceptance a, maximum likelihood under Leviathan's i.i.d. model.

    A round that drafted d tokens and accepted j has likelihood a^j (1 - a) if
    j < d (a rejection was seen), a^d if j == d. So
    a = accepted tokens / (accepted tokens + rounds with a rejection).
    """
    acc = rej = 0
    for d, j in zip(drafted, accepted):
        if d <= 0:
            continue
        acc += j
        rej += int(j < d)
    return acc / (acc + rej) if acc + rej else None


def alpha_from_acceptance_length(length: float, k: float) -> float | None:
    """The a with (1 - a^(K+1)) / (1 - a) = length (bisection): used when per-round draft sizes are unknown."""
    if not k or length is None or not math.isfinite(length):
        return None
    if length <= 1.0:
        return 0.0
    if length >= k + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, k) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def paired_ratio_interval(
    requests: Mapping[str, Mapping[str, tuple[float, float]]],
    mode: str,
    against: Sequence[str],
    *,
    level: float = 0.9,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """How far `mode`'s rate over the best of `against` could move with other prompts: a paired bootstrap.

    requests: mode -> prompt id -> (tokens, seconds) of that prompt's request; every mode ran the same
    prompts, so a draw resamples prompt ids (with replacement) and each mode's rate is its tokens over its
    seconds on them. The ratio is the mode's rate over the best rate among `against` in that same draw:
    the best is chosen again each time, so picking the best of many noisy modes (which flatters it) is
    inside the interval. Returns its central `level` share, (low, high); None when a mode lacks a prompt
    the others ran, or no prompt ran at all.
    """
    modes = [mode, *against]
    if any(m not in requests for m in modes):
        return None
    prompts = sorted(requests[mode])
    if not prompts or any(set(requests[m]) != set(prompts) for m in modes):
        return None
    rng = random.Random(seed)
    table = [[requests[m][p] for p in prompts] for m in modes]  # [mode][prompt] = (tokens, seconds)
    ratios = []
    for _ in range(draws):
        picked = [rng.randrange(len(prompts)) for _ in prompts]
        rates = []
        for rows in table:
            seconds = sum(rows[i][1] for i in picked)
            rates.append(sum(rows[i][0] for i in picked) / seconds if seconds > 0 else 0.0)
        best = max(rates[1:])
        if best > 0:
            ratios.append(rates[0] / best)
    if not ratios:
        return None
    tail = (1.0 - level) / 2 * 100.0
    return percentile(ratios, tail), percentile(ratios, 100.0 - tail)
