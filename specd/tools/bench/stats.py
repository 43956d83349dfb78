"""Statistics and the theory the bench compares against: percentiles, per-token acceptance a, S(K)."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
