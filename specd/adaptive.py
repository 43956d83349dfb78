"""Adaptive draft length: choose K per round from measured acceptance and cost.

Expected speed-up of a round with draft length K (Leviathan et al. 2023),
for per-token acceptance a and draft/target cost ratio c:

    S(K) = (1 - a^(K+1)) / ((1 - a) (K c + 1))

The controller keeps running estimates of a and c per session (seeded from
the service-wide estimate), picks the K in [1, k_max] that maximises S, and
drafts nothing (K = 0) when no K pays, probing again every `probe_every`
rounds so that a session whose text became predictable gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_speedup(a: float, c: float, k: int) -> float:
    """S(K); K = 0 is target-only (1.0)."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / ((1.0 - a) * (k * c + 1.0))


def best_draft_length(a: float, c: float, k_max: int, *, min_gain: float = 1.0) -> int:
    """The K in [1, k_max] with the largest S(K), or 0 if none beats min_gain."""
    best_k, best_s = 0, min_gain
    for k in range(1, k_max + 1):
        s = expected_speedup(a, c, k)
        if s > best_s:
            best_k, best_s = k, s
    return best_k


@dataclass
class Estimate:
    """Exponentially weighted running mean."""

    value: float
    weight: float = 0.0  # how much evidence backs `value` (saturates)

    def update(self, sample: float, n: float = 1.0, *, horizon: float = 32.0) -> None:
        alpha = n / min(horizon, self.weight + n)
        self.value += alpha * (sample - self.value)
        self.weight = min(horizon, self.weight + n)


@dataclass
class AdaptiveDraftLength:
    """Per-session K controller; feed it every speculative round's outcome."""

    k_max: int
    acceptance: Estimate
    cost_ratio: Estimate
    probe_every: int = 16
    _rounds_off: int = 0

    def next_k(self) -> int:
        k = best_draft_length(self.acceptance.value, self.cost_ratio.value, self.k_max)
        if k > 0:
            self._rounds_off = 0
            return k
        self._rounds_off += 1
        if self._rounds_off >= self.probe_every:  # probe: the text may have become predictable
            self._rounds_off = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        """One verified round: `accepted` of `drafted` tokens; compute times as the services report them."""
        observe_round(self.acceptance, self.cost_ratio, drafted, accepted, draft_ms, verify_ms)


def observe_round(
    acceptance: Estimate, cost_ratio: Estimate, drafted: int, accepted: int, draft_ms: float, verify_ms: float
) -> None:
    """Update acceptance and cost estimates with one verified round (nothing drafted: nothing learnt)."""
    if drafted <= 0:
        return
    # Per-token acceptance from "accepted before the first rejection": the
    # maximum-likelihood a for a truncated geometric observation.
    trials = accepted + (0 if accepted == drafted else 1)
    acceptance.update(accepted / trials, n=trials)
    if draft_ms > 0 and verify_ms > 0:  # a pipelined draft's time was hidden: no cost sample
        cost_ratio.update((draft_ms / drafted) / verify_ms)
