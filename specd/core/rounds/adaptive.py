"""Adaptive draft length: choose K per round from measured acceptance and cost.

Expected speed-up of a round with draft length K (Leviathan et al. 2023),
for per-token acceptance a and draft/target cost ratio c:

    S(K) = (1 - a^(K+1)) / ((1 - a) (K c + 1))

(extended below with the batch share sigma and the draft call's overhead).
The controller keeps running estimates of a and c per session and reads
them against the service-wide estimates, live: a session with little
evidence of its own follows what every other session is seeing right now
(a bad draft is switched off for all concurrent sessions after their first
rounds, not after ten rounds of each), and its own text takes over as its
evidence grows. It picks the K in [1, k_max] that maximises S, and drafts
nothing (K = 0) when no K is predicted to beat target-only by a margin
(`min_gain`: the estimates are noisy, and a small predicted gain is as
likely a loss), probing again (K = 1) after 16 such rounds so
that a session whose text became predictable gets speculation back. A
probe costs about a round (the draft catches up on the session's whole
text), so the wait doubles after each probe that fails, up to 256 rounds. With
a shared `ProbeBudget` the rounds and the wait are counted service-wide, over
all sessions together: a draft that does not pay is left alone under load
and across short requests, instead of being probed once per session.

Under batching a verify of K + 1 tokens is no longer as cheap as a one-token
step: the target's step time grows with the tokens of the whole batch,
T(n) = base + per_token * n (fitted online by `LinearCost` from the verdicts).
With B sessions each verifying K + 1 tokens, a round costs
base + per_token * B (K + 1) against base + per_token * B for target-only, so
every draft token adds a share

    sigma = per_token * B / (base + per_token * B)

of a target-only step on top of its drafting cost c. S(K) then uses
c + sigma: at batch 1 on a GPU sigma is ~0 (Leviathan's model); as the batch
grows sigma approaches 1 and K shrinks, down to no speculation. The fit
sees decode steps only: a prefill's hundreds of tokens would set the slope
to the prefill's per-token cost, far below what the first extra decode
token costs on a CPU (docs/results/code-choices.md).

A round that drafts also waits for the draft call itself: beyond the
draft's compute, the hop there and back (wire, queue, wake), a fixed
cost per drafting round whatever K is. It enters S(K) as `overhead`, in
target steps, measured from the call's wall time:

    S(K) = (1 - a^(K+1)) / ((1 - a) (1 + overhead + K (c + sigma)))

Without it, a cheap drafter that is rarely right (a suffix drafter on
text it has not seen) looks free and is kept on at a loss.
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

    def observe(self, tokens: float, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
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
        if self._w < 8:
            return self._last
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_variance or var < 1e-4 * mx * mx:  # (near) constant token counts: slope unknown now
            return self._last
        slope = max(0.0, (self._xy / self._w - mx * my) / var)
        self._last = (max(0.0, my - slope * mx), slope)
        return self._last

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


def blend(own: Estimate, prior: Estimate | None, prior_weight: float) -> float:
    """own's value shrunk towards prior's by their evidence: prior_weight against own.weight."""
    if prior is None:
        return own.value
    if own.weight <= 0:
        return prior.value
    return (prior_weight * prior.value + own.weight * own.value) / (prior_weight + own.weight)


@dataclass
class AdaptiveDraftLength:
    """Per-session K controller; feed it every speculative round's outcome.

    acceptance / cost_ratio: this session's own evidence. service_acceptance /
    service_cost_ratio: the shared, live service-wide estimates (not copied:
    read every round), worth `prior_weight` observations against the session's.
    probes: when to probe after K = 0 rounds; pass a shared one to count service-wide.
    overhead: a drafting round's fixed cost in target steps (the draft call's hop),
    service-wide like the hop itself; None: 0.
    min_gain: the predicted S(K) a round must beat to draft. Above 1 because
    the estimates are noisy: a (about 32 rounds of evidence) has a standard
    error near 0.08 at a = 0.25, which moves S by about 0.06; a gain smaller
    than that is as likely a loss, and a loss is what auto must not make.
    """

    k_max: int
    acceptance: Estimate
    cost_ratio: Estimate
    service_acceptance: Estimate | None = None
    service_cost_ratio: Estimate | None = None
    prior_weight: float = 4.0
    probes: ProbeBudget = field(default_factory=ProbeBudget)
    overhead: Estimate | None = None
    min_gain: float = 1.05

    @property
    def expected_acceptance(self) -> float:
        return blend(self.acceptance, self.service_acceptance, self.prior_weight)

    @property
    def expected_cost_ratio(self) -> float:
        return blend(self.cost_ratio, self.service_cost_ratio, self.prior_weight)

    def next_k(self, batch_share: float = 0.0) -> int:
        """K for the next round; batch_share is sigma (see the module docstring), 0 unbatched."""
        overhead = 0.0 if self.overhead is None else self.overhead.value
        k = best_draft_length(
            self.expected_acceptance,
            self.expected_cost_ratio + batch_share,
            self.k_max,
            overhead=overhead,
            min_gain=self.min_gain,
        )
        if k > 0:
            self.probes.speculating()
            return k
        return 1 if self.probes.round_off() else 0  # probe: the text may have become predictable

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


@dataclass
class ServiceEstimates:
    """What every session's controller reads live: service-wide acceptance, cost and target load.

    The starting guesses count as two rounds, so one unlucky first round cannot
    switch a good draft off for everyone. The target's step time against the
    tokens of its batch, and the batch it sees, give sigma (`batch_share`).
    """

    acceptance: Estimate = field(default_factory=lambda: Estimate(0.5, weight=2.0))
    cost_ratio: Estimate = field(default_factory=lambda: Estimate(0.2, weight=2.0))
    overhead: Estimate = field(default_factory=lambda: Estimate(0.0))  # the draft call's hop, in target steps
    probes: ProbeBudget = field(default_factory=ProbeBudget)  # sessions that stopped speculating take turns
    target_cost: LinearCost = field(default_factory=LinearCost)
    target_batch: Estimate = field(default_factory=lambda: Estimate(1.0))

    def controller(self, k_max: int) -> AdaptiveDraftLength:
        """A session's K controller: its own evidence (none yet), shrunk towards these estimates."""
        return AdaptiveDraftLength(
            k_max=k_max,
            acceptance=Estimate(0.0),  # weight 0: no evidence of its own yet (blend reads the service's)
            cost_ratio=Estimate(0.0),
            service_acceptance=self.acceptance,
            service_cost_ratio=self.cost_ratio,
            probes=self.probes,
            overhead=self.overhead,
        )

    def batch_share(self) -> float:
        """sigma: what one more draft token per session costs the batched target, in target-only steps."""
        return self.target_cost.share(self.target_batch.value)

    def observe_target(self, batch_tokens: int, batch_size: int, verify_ms: float, max_decode_tokens: int) -> None:
        """A target step: batch_tokens positions over batch_size sessions in verify_ms.

        Only decode steps (at most max_decode_tokens per session: K + 1) feed
        the cost fit; a step with a prefill or a catch-up in it does not say
        what one more draft token costs."""
        if 0 < batch_tokens <= max(1, batch_size) * max_decode_tokens:
            self.target_cost.observe(batch_tokens, verify_ms)
        if batch_tokens > 0:
            self.target_batch.update(batch_size, horizon=64.0)

    def observe(
        self,
        ctl: AdaptiveDraftLength,
        drafted: int,
        accepted: int,
        draft_ms: float,
        verify_ms: float,
        draft_wall_ms: float = 0.0,
    ) -> None:
        """A verified round, fed to the session's controller and to the service-wide estimates.

        draft_wall_ms: how long the round waited for its draft call (0: it did
        not, the draft was pipelined or there was none); what it took beyond
        the draft's compute is the hop, the round's fixed overhead."""
        ctl.observe(drafted, accepted, draft_ms, verify_ms)
        observe_round(self.acceptance, self.cost_ratio, drafted, accepted, draft_ms, verify_ms)
        if drafted > 0 and draft_wall_ms > 0 and verify_ms > 0:
            self.overhead.update(max(0.0, draft_wall_ms - draft_ms) / verify_ms)


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
