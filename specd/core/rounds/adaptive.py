"""The pieces adaptive choices are built from: running estimates, an online cost fit and S(K).

Expected speed-up of a round with draft length K (Leviathan et al. 2023),
for per-token acceptance a, draft/target cost ratio c and a drafting
round's fixed cost `overhead` (the draft call's hop), in target steps:

    S(K) = (1 - a^(K+1)) / ((1 - a) (1 + overhead + K c))

The hybrid drafter picks its model's K with it (`best_draft_length`) and
the bench reports efficiency against it. The round loop's automatic K and
pipeline (specd.core.rounds.auto) measure cycles instead: S(K) is the
model's view of one cost, the host's own work is not in it.

- `Estimate`: an exponentially weighted mean with its evidence;
- `LinearCost`: time = base + per_token x tokens, fitted online with forgetting;
- `ProbeBudget`: when a switched-off draft is tried again, counted over the sessions sharing it;
- `PositionAcceptance`: a request's acceptance per draft position (the speculation cache's branch choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_speedup(a: float, c: float, k: int, overhead: float = 0.0) -> float:
    """S(K); K = 0 is target-only (1.0). overhead: a drafting round's fixed cost (the draft call's hop), in steps."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / ((1.0 - a) * (1.0 + overhead + k * c))


def best_draft_length(a: float, c: float, k_max: int, *, overhead: float = 0.0, min_gain: float = 1.0) -> int:
    """The K in [1, k_max] with the largest S(K), or 0 if none beats min_gain."""
    best_k, best_s = 0, min_gain
    for k in range(1, k_max + 1):
        s = expected_speedup(a, c, k, overhead)
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
class LinearCost:
    """Online least-squares fit of step time = base + per_token * tokens, forgetting old steps.

    Fed (tokens the batch's forward ran, its time); the batches' changing
    composition (sessions joining with their prompts, different K) spreads
    the token counts, which is what makes the slope identifiable.
    """

    forget: float = 0.99  # per observation; ~100 steps of memory
    min_variance: float = 0.05  # token-count variance the slope needs (batch 1: ~5% of steps one token longer)
    _last: tuple[float, float] | None = None  # the last identified fit, kept while the counts stop varying
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _fitted: bool = False  # fit() is read many times a round (auto rates every arm) and changes only here

    def observe(self, tokens: float, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        self._fitted = False
        f = self.forget
        self._w = f * self._w + 1.0
        self._x = f * self._x + tokens
        self._y = f * self._y + ms
        self._xx = f * self._xx + tokens * tokens
        self._xy = f * self._xy + tokens * ms

    def fit(self) -> tuple[float, float] | None:
        """(base_ms, per_token_ms), or None until the token counts have varied enough to tell them apart.

        Once identified, the fit outlives a stretch of constant counts (a
        controller that stopped drafting sees one-token steps only): the
        slope is the hardware's, it does not vanish when nobody drafts.
        """
        if not self._fitted:
            self._refit()
            self._fitted = True
        return self._last

    def _refit(self) -> None:
        """Bring `_last` up to date with the observations (kept as it is while they cannot identify a slope)."""
        if self._w < 8:
            return
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_variance or var < 1e-4 * mx * mx:  # (near) constant token counts: slope unknown now
            return
        slope = max(0.0, (self._xy / self._w - mx * my) / var)
        if my - slope * mx < 0.0:
            # A slope too steep for the data (a few slow calls at the rarer count): a cost has no negative
            # base, so fit it through the origin, which stays near the measured mean. Clamping the base to
            # 0 and keeping the slope overstates every count above the mean (emulated h100-tp2-70b: K = 1
            # drafts at 9 ms fitted as 12.3 ms per token, so auto never ran K = 2).
            slope = (self._xy / self._w) / (self._xx / self._w)
        self._last = (max(0.0, my - slope * mx), slope)

    def mean(self) -> float | None:
        """The (forgetting) mean time observed, or None before any observation."""
        return self._y / self._w if self._w > 0 else None

    def mean_tokens(self) -> float | None:
        """The (forgetting) mean token count observed, or None before any observation."""
        return self._x / self._w if self._w > 0 else None

    def share(self, batch_size: float) -> float:
        """sigma: the cost of one more token per session, as a fraction of a target-only step (0 if unknown)."""
        fitted = self.fit()
        if fitted is None:
            return 0.0
        base, per_token = fitted
        marginal = per_token * max(1.0, batch_size)
        total = base + marginal
        return marginal / total if total > 0 else 0.0


@dataclass
class ProbeBudget:
    """When rounds that draft nothing should probe instead, counted over every session that shares it.

    The first probe comes after `every` such rounds; each probe that does not
    bring speculation back doubles the wait, up to `max_every`: a probe costs
    about a round (the draft catches up on the whole text), so a draft that
    keeps failing is probed ever more rarely. Any session that chooses to
    speculate resets the wait.
    """

    every: int = 16
    max_every: int = 256
    _wait: int = field(init=False)
    _rounds_off: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._wait = self.every

    def round_off(self) -> bool:
        """Count a round that drafts nothing; True when it should probe instead."""
        self._rounds_off += 1
        if self._rounds_off >= self._wait:
            self._rounds_off = 0
            self._wait = min(self.max_every, 2 * self._wait)
            return True
        return False

    def speculating(self) -> None:
        """A session chose K > 0: the draft pays somewhere, so probe eagerly again."""
        self._wait = self.every


@dataclass
class PositionAcceptance:
    """Measured acceptance per draft position, conditional on the positions before it being accepted.

    Counts a request's verdicts: position i was reached when the first i
    drafts were accepted, and accepted when the first i + 1 were. The rate is
    shrunk towards `prior` by `prior_weight` verdicts, so the first rounds
    follow the prior and the request's own text takes over.
    """

    prior: float = 0.7
    prior_weight: float = 2.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verdict: `accepted` of `drafted` draft tokens."""
        if drafted > len(self.reached):
            grow = drafted - len(self.reached)
            self.reached.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for i in range(min(drafted, accepted + 1)):
            self.reached[i] += 1
            self.accepted[i] += int(i < accepted)

    def rates(self, k: int) -> tuple[float, ...]:
        """a_0 .. a_{k-1}; positions never reached take the prior."""
        out = []
        for i in range(k):
            n = self.reached[i] if i < len(self.reached) else 0
            hits = self.accepted[i] if i < len(self.accepted) else 0
            out.append((hits + self.prior * self.prior_weight) / (n + self.prior_weight))
        return tuple(out)
