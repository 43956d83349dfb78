"""Auto: each round's draft length and pipeline, chosen from what rounds really cost.

An *arm* is a way to run a round: a pipeline strategy (specd.core.rounds.pipeline)
and a draft length K; K = 0 is a target-only round. Per round the controller
picks the arm with the best expected rate

    rate(arm) = E[tokens | K] / cycle(arm)

where the tokens are modelled and the cycle is measured:

- **E[tokens | K]** = 1 + sum_{i=1..K} prod_{j<i} a_j, with a_j the
  acceptance at draft position j given the ones before it were accepted:
  this request's verdicts, shrunk towards the service's (`AcceptanceModel`).
  Post-verify commits no bonus on an all-accepted round: the bonus position
  becomes the next round's first draft token, counted in that round's K, so
  such a round commits K tokens: minus P(all K accepted).
- **cycle(arm)**: the wall time from one round's verify going out to the
  next round's, as the loop sees it: the verify with its hops and the
  target's batch, the pipeline's settle, the next round's wait for its draft
  (none on a pipeline hit) and the loop's own work. Host costs, wire, queues
  and batching are in it as they are, not as a model thinks they are. It is
  measured per workload class (greedy or sampled; the number of requests
  running, in powers of two; the classes of one kind share their acceptance,
  and a class with no call measured yet is rated with the costs of the
  nearest one that has) and predicted as a model of it plus what the
  arm's family measured beyond that model:

      model(off, K) = v(K + 1) + d(K)
      model(p, K)   = max(v(K + 1), pre_p(K)) + (1 - h_p(K)) d(K)    (p pipelined)

  plus o. v(n): a verify call's wall for n tokens, fitted online
  (`LinearCost`); d(K): a fresh K-token draft call's hops (its wall less the
  draft's compute and less its queue time in the draft service, where a miss
  waits for the pre-draft, already in max(v, pre)) plus that compute, fitted
  against K; pre_p(K): the
  pipeline's pre-draft, which runs beside the verify, so one longer than the
  verify is waited for even on a hit (d(K + 1) from a guessed bonus, d(K)
  for post-verify, plus what that pipeline's calls measured beyond it); o: what
  the arm's family's (pipeline's, or target-only's) measured cycles exceed
  their model by, shrunk towards 0 by `correction_prior`, and for a pipelined
  arm its own excess shrunk towards that by `arm_correction_prior` rounds;
  h_p: the pipeline's hit chance from the acceptance model (off 0,
  post-verify P(all K), bonus-match P(all K) a_K, spec-cache the mean of
  P(all K) and 1), corrected by the hits measured per pipeline. Both excesses
  average over `horizon` rounds. Per pipelined arm, because the excess depends on K: on
  emulated h100-tp2-70b (agreement 0.8, T = 0) spec-cache's was -3 ms pooled,
  its K = 1 rounds staged nearly always and its K = 2 rounds seldom, and the
  pooled figure rated K = 1 level with K = 2 (auto alternated; speccache-2
  gave 2.23x target-only, auto 1.96x).

A pipelined arm is chosen over the best arm without one only for an
expected rate `pipeline_margin` (5%) above it, and is neither chosen nor
explored where the fresh draft's wait d(K), all a pipeline can hide, is
under that share of the cycle: a pipeline's own costs (an extra draft call,
a staged message, the CPU those take on a shared host) are not in the
model, and a draft that costs next to nothing (n-gram, suffix) leaves a
pipeline nothing to hide (docs/performance.md).

**Probing a target-only choice.** A target-only round brings no verdict, so
where target-only rates best, target-only's neighbours are rated again with
the service's acceptance at its Wilson upper bound (`probe_z`), and the best
of them runs if it beats target-only (`AutoChooser.probe`): a few unlucky
verdicts cannot stop speculation for good, and a useless draft closes the
bound within a few verdicts. One probe goes out at a time per class (the
next waits for a verdict): requests that start together learn it once.

**Exploration, and what it can cost.** One round in `explore_every` (counted
over the whole service) runs a neighbour of the best arm instead, the one
measured longest ago: K - 1, K + 1, the other pipelines at K, and
target-only (or K = 1 from target-only), among those rated within
`explore_within` (15%) of the best, and in one exploration of
`explore_far_every` (4) among them all. That keeps every arm the best could
move to measured under today's load, and bounds the loss to
(1 / explore_every) x (1 - the worst neighbour's rate / the best's): at 24
and a neighbour at 0.7x, 1.25% (a neighbour that breaks the pipeline costs
the next round its pre-draft too, which the closeness keeps to the far
explorations). Where target-only is the best, one round in
`explore_target_only_every` (72): such a round pays a whole fresh draft for
one verdict, and while the evidence is too thin to rule drafting out the
probe drafts anyway; at a neighbour at 0.7x, 0.4% (with a useless draft on
emulated h100-8b, auto's drafting rounds went from 30 to 15 of 576). A request
explores (one target-only round in `shadow_every`, 8, by a seeded coin: a guess
costs no wall time, and at a fixed stride it sampled one phase of a periodic
text), and probes, from target-only by a shadow guess instead: the round stays
target-only and the draft's guess of the token, asked beside the verify, is
compared with the token the round commits, at no wall time. At T = 0 the guess
is the draft's argmax, right exactly when a K = 1 draft would be accepted; at
T > 0 it is drawn at the target's coin (bonus-match's guess of a bonus, which a
target-only round's token is), right a little less often than a K = 1 draft is
accepted (emulated h100-8b, T = 0.7, 400 positions: 0.34 / 0.71 / 0.91 against
0.40 / 0.73 / 0.95 at agreements 0.6 / 0.8 / 0.95; 0.00 at 0): a K = 1 verdict
on the low side, where it only ever keeps a request target-only. A right guess
makes the next round a drafting exploration, which measures the arms' costs and
acceptance again (a guess measures no cost). Before, a sampled request explored
by drafting: one round in 72 a K = 1 round of 17 ms against 9 (emulated
h100-8b, agreement 0, T = 0.7), and every request probed by drafting (a bench
cell of 6 requests of 48 tokens there: 6 probes). After a
bad stretch the acceptance of the request's own exploration rounds brings
speculation back: a request whose text became predictable speculates again
within a few exploration rounds (tests/unit/core/rounds/test_auto.py bounds
it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from specd.core.rounds.adaptive import Estimate, LinearCost
from specd.core.rounds.request_spread import RequestSpread
from specd.core.sampling.proposal import Proposal

OFF, BONUS_MATCH, POST_VERIFY, SPEC_CACHE = "off", "bonus-match", "post-verify", "spec-cache"
PIPELINE_AUTO = "auto"  # a request's or the coordinator's pipeline setting: chosen per round by this module


class Arm(NamedTuple):
    """A way to run a round: a pipeline strategy's name and the draft length (0: target-only).

    A named tuple, not a frozen dataclass: a choice hashes arms ~80 times (dicts of ratings,
    measurements per arm), and a dataclass's hash runs in Python."""

    pipeline: str
    k: int


TARGET_ONLY = Arm(OFF, 0)


@dataclass
class AcceptanceModel:
    """Acceptance per draft position with forgetting: a_i = P(position i accepted | the ones before were).

    Counts decay by `forget` per verdict (about 1 / (1 - forget) verdicts of
    memory), so it follows a workload that changes. A position's rate is
    shrunk towards the pooled rate over all positions (few verdicts reach the
    deep ones), and that towards a prior.
    """

    forget: float = 0.995
    position_weight: float = 16.0  # the pooled rate counts as this many verdicts at each position
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    version: int = 0  # changes with every verdict or aging: what readers cache their rates against
    verdicts: int = 0  # verdicts observed, never forgotten
    accepting: int = 0  # ... of which accepted a draft token: the only ones that can speak for drafting

    def observe(self, drafted: int, accepted: int) -> None:
        """One verdict: `accepted` of `drafted` draft tokens (accepted before the first rejection)."""
        if drafted <= 0:
            return
        self.verdicts += 1
        self.accepting += accepted > 0
        self.age()
        if drafted > len(self.reached):
            grow = drafted - len(self.reached)
            self.reached.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        for i in range(min(drafted, accepted + 1)):
            self.reached[i] += 1.0
            self.accepted[i] += float(i < accepted)

    def age(self) -> None:
        """What was seen so far loses one verdict's weight (`forget`)."""
        self.version += 1
        f = self.forget
        if f < 1.0:
            self.reached = [f * n for n in self.reached]
            self.accepted = [f * n for n in self.accepted]

    def pooled(self, prior: float, prior_weight: float) -> float:
        """The rate over every position, shrunk towards prior by prior_weight trials."""
        return (sum(self.accepted) + prior * prior_weight) / (sum(self.reached) + prior_weight)

    def rates(
        self, k: int, prior: float, prior_weight: float, shape: Sequence[float] = (), position_weight: float = 0.0
    ) -> list[float]:
        """a_0 .. a_{k-1}: each position shrunk towards the pooled rate, which is shrunk towards prior.

        With `shape` (a rate per position whose pooled rate is `prior`: the service's), position i is
        shrunk instead towards shape[i] moved by this model's pooled level in log-odds: a drafter whose
        acceptance rises with depth (a suffix match that holds once it starts) keeps that profile in a
        request that has few verdicts at the deep positions of its own. position_weight: the pooled rate's
        weight at each position where it is to count for more than `self.position_weight`."""
        pooled = self.pooled(prior, prior_weight)
        shift = _logit(pooled) - _logit(prior)
        w = max(self.position_weight, position_weight)
        out = []
        for i in range(k):
            n = self.reached[i] if i < len(self.reached) else 0.0
            hits = self.accepted[i] if i < len(self.accepted) else 0.0
            base = _expit(_logit(shape[i]) + shift) if i < len(shape) else pooled
            out.append((hits + base * w) / (n + w))
        return out


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


def _expit(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def upper_bound(rate: float, trials: float, z: float) -> float:
    """The upper end of Wilson's score interval for a rate measured over `trials` (z: its width in sigmas)."""
    if trials <= 0:
        return 1.0
    z2 = z * z
    centre = rate + z2 / (2.0 * trials)
    spread = z * math.sqrt(max(rate * (1.0 - rate), 0.0) / trials + z2 / (4.0 * trials * trials))
    return min(1.0, (centre + spread) / (1.0 + z2 / trials))


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """E[tokens a round commits] with k draft tokens: 1 + sum_{i=1..k} prod_{j<i} a_j."""
    total, reach = 1.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


def all_accepted(rates: Sequence[float], k: int) -> float:
    """P(all k draft tokens accepted)."""
    p = 1.0
    for a in rates[:k]:
        p *= a
    return p


# Per pipeline: (P(hit | every draft accepted), P(hit | a rejection)) before any is measured. Post-verify
# hits exactly when all were accepted; bonus-match also needs its guess of the bonus (None here: the
# acceptance of draft position K + 1, see `bonus_guess_prior`); the speculation cache covers the
# all-accepted verdict with its bonus guesses and the likeliest rejections too.
HIT_PRIORS: dict[str, tuple[float | None, float]] = {
    OFF: (0.0, 0.0),
    POST_VERIFY: (1.0, 0.0),
    BONUS_MATCH: (None, 0.0),
    SPEC_CACHE: (1.0, 0.5),
}


def bonus_guess_prior(rates: Sequence[float], k: int) -> float:
    """Before any is measured, P(the draft's guess of the bonus is the target's bonus | all k accepted):
    the acceptance of draft position k + 1 (the guess is that position's draft token). At T = 0 it is
    that event; at T > 0 the guess is drawn at the target's bonus coin (specd.core.sampling.bonus_guess),
    right at most as often as the best coupling of q and p, 1 - TV(p, q), which is what a draft token's
    acceptance is: an upper bound, which is the safe side: an arm rated too high is run, and its
    measured hits correct it; one rated too low (the 0.5 used before) is rarely run and stays unmeasured."""
    if not rates:
        return 0.5
    return rates[k] if k < len(rates) else rates[-1]


_STRUCTURAL = {POST_VERIFY: (False, True), BONUS_MATCH: (True, True)}  # parts fixed by how the strategy works


def prior_hits(pipeline: str, rates: Sequence[float], k: int) -> tuple[float, float]:
    """The pipeline's (P(hit | all k accepted), P(hit | a rejection)) before any is measured."""
    h_all, h_rejected = HIT_PRIORS.get(pipeline, (0.0, 0.0))
    return (bonus_guess_prior(rates, k) if h_all is None else h_all), h_rejected


def hit_chance(pipeline: str, rates: Sequence[float], k: int, given: tuple[float, float] | None = None) -> float:
    """The chance that this round's pre-draft is the next round's draft:
    P(all k accepted) h_all + (1 - P(all k accepted)) h_rejected, with (h_all, h_rejected) = given or the prior."""
    if k <= 0 or pipeline == OFF:
        return 0.0
    h_all, h_rejected = given if given is not None else prior_hits(pipeline, rates, k)
    p_all = all_accepted(rates, k)
    return p_all * h_all + (1.0 - p_all) * h_rejected


def arm_tokens(arm: Arm, rates: Sequence[float]) -> float:
    """E[tokens | arm] (see the module docstring)."""
    tokens = expected_tokens(rates, arm.k)
    if arm.pipeline == POST_VERIFY and arm.k > 0:
        tokens -= all_accepted(rates, arm.k)
    return tokens


@dataclass
class ConfidenceCalibration:
    """P(accepted | the drafter's own confidence, given the tokens before it were), binned, from verdicts.

    A drafter's confidence (Proposal.confidence: a model's probability of its
    token, a suffix match's continuation frequency) is a score, not a
    probability of acceptance: this maps it to one. Bins on [0, 1], counts
    forgotten by `forget` per verdict; a bin with few verdicts leans on the
    prior (the pooled acceptance).
    """

    bins: int = 10
    forget: float = 0.998
    prior_weight: float = 4.0
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def observe(self, confidence: Sequence[float], accepted: int) -> None:
        """A verdict on tokens with these confidences: the first `accepted` accepted, the next rejected."""
        if not confidence:
            return
        if not self.reached:
            self.reached, self.accepted = [0.0] * self.bins, [0.0] * self.bins
        f = self.forget
        self.reached = [f * n for n in self.reached]
        self.accepted = [f * n for n in self.accepted]
        for i, c in enumerate(confidence[: accepted + 1]):
            b = self._bin(c)
            self.reached[b] += 1.0
            self.accepted[b] += float(i < accepted)

    def pooled(self, prior: float) -> float:
        """The acceptance over every bin, shrunk towards prior."""
        return (sum(self.accepted) + prior * self.prior_weight) / (sum(self.reached) + self.prior_weight)

    def calibrated(self, confidence: Sequence[float], prior: float) -> list[float]:
        """Per token: the acceptance its confidence's bin measured, shrunk towards prior."""
        if not self.reached:
            return [prior] * len(confidence)
        w = self.prior_weight
        out = []
        for c in confidence:
            b = self._bin(c)
            out.append((self.accepted[b] + prior * w) / (self.reached[b] + w))
        return out


def waited(pipeline: str, verify: float, draft: float, pre_draft: float, hit: float) -> float:
    """A round's modelled cycle in ms: v + d without a pipeline; with one, max(v, pre) + (1 - h) d.

    The pre-draft runs beside the verify, so the next round waits for the longer of the two (one
    longer than the verify is on the critical path even when it hits: in the first issue-30 grid,
    emulated h100-tp2-70b, auto's pipelined rounds at mean K 3.0 had 16.5 ms of round overhead, spec-cache-2's 3.8),
    then, on a miss, for a fresh draft (`AutoChooser.pre_draft` rates pre per pipeline)."""
    if pipeline == OFF:
        return verify + draft
    return max(verify, pre_draft) + (1.0 - hit) * draft


def _family(arm: Arm) -> str:
    """What an arm's residual and hit rate are pooled over: its pipeline, or target-only."""
    return "target-only" if arm.k == 0 else arm.pipeline


@dataclass
class ArmCycles:
    """What one workload class measured: call costs, per-pipeline corrections, acceptance."""

    verify_ms: LinearCost = field(default_factory=LinearCost)  # verify call wall against its tokens
    # A fresh draft call: its compute against K (the draft's own figure; the call's wall where it reports
    # none), and its wall beyond that, less its queue (hops, batch and reply: the same whatever K). Apart,
    # because K barely varies while auto settles: a wall fitted against K then put the hops into the slope.
    draft_ms: LinearCost = field(default_factory=LinearCost)
    draft_hops_ms: Estimate = field(default_factory=lambda: Estimate(0.0))
    residual_ms: dict[str, Estimate] = field(default_factory=dict)  # per family: measured cycle - model
    arm_residual_ms: dict[Arm, Estimate] = field(default_factory=dict)  # per arm (read for pipelined arms)
    hits: dict[tuple[str, bool], Estimate] = field(default_factory=dict)  # (pipeline, all accepted) -> P(hit)
    # per pipeline: its pre-draft call's wall (out beside the verify -> answer) less the fresh draft it stands for
    pre_draft_excess_ms: dict[str, Estimate] = field(default_factory=dict)
    last_seen: dict[Arm, int] = field(default_factory=dict)  # the class's round count at the arm's last cycle
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)  # every request's verdicts
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)  # the drafter's confidence
    spread: RequestSpread = field(default_factory=RequestSpread)  # finished requests: a request's prior weight
    key: tuple[bool, int] = (True, 0)  # (greedy, log2 of the requests running): AutoPolicy.workload's
    rounds: int = 0
    longest: int = 0  # the most draft tokens a verify of this class carried: K grows from there one at a time
    version: int = 0  # changes with every call observed (the fits): what a chooser caches its cost table against
    # The last probe (AutoChooser.probe): the acceptance's verdict count and the class's rounds when it went out.
    # Another waits for a verdict since (or `probe_hold` rounds): requests that start together probe once.
    probe_verdicts: int = -1
    probe_round: int = 0
    # A request with no verdict of its own rates what any such request of its settings rates: the last such
    # target-only rating, ((its settings, the kind's accepting verdicts), the class's rounds then), held for
    # the next ones (`AutoChooser.choose`). At 32 streams of 8-token requests each first round rated every
    # arm: 0.03 ms of the coordinator's 0.25 a round.
    fresh_target_only: tuple[tuple[object, ...], int] | None = None

    def may_probe(self, hold: int) -> bool:
        """True once a verdict arrived since the last probe went out, or `hold` rounds passed without one."""
        return self.acceptance.verdicts > self.probe_verdicts or self.rounds - self.probe_round >= hold

    def probed(self) -> None:
        """A probe goes out now."""
        self.probe_verdicts, self.probe_round = self.acceptance.verdicts, self.rounds


@dataclass(frozen=True)
class _CostTable:
    """One class's predicted walls at one moment, by token count."""

    verify: list[float]  # [n]: v(n), a verify call of n tokens (K drafts: n = K + 1)
    draft: list[float]  # [k]: d(k), a fresh k-token draft call
    pre_draft: list[float]  # [k]: d(k + 1) with d's fallback at v(k + 1), as a pipeline's pre-draft is rated


def _predict(cost: LinearCost, x: float) -> float | None:
    """cost's fitted time at x; before the slope is known, the mean time seen (slope 0); None before any."""
    fitted = cost.fit()
    if fitted is not None:
        return fitted[0] + fitted[1] * x
    return cost.mean()


@dataclass(frozen=True)
class AutoSettings:
    explore_every: int = 24  # one round in this many (service-wide) runs a neighbour of the best arm
    # ... and where target-only is the best: each such round pays a fresh draft for one verdict, and the
    # probe (`probe_z`) already drafts while the evidence is too thin to rule drafting out
    explore_target_only_every: int = 72
    # ... except for a request that guesses (shadow): its exploration from target-only is a guess at no wall
    # time (the draft's idle compute and one call's CPU), so one target-only round in this many guesses
    # and keeps the acceptance that holds it target-only fresh. At one in 72, a few unlucky verdicts held
    # it: emulated h100-8b, agreement 0.6, T = 0, three runs of 1,200-1,600 rounds, auto stayed target-only
    # in two (position 1 estimated at 0.26 and 0.35 over 62 and 116 verdicts, where K = 1 spec-cache's
    # rounds accept 0.39 and give 11% more).
    shadow_every: int = 8
    explore_seed: int = 0  # of the coin that picks which target-only rounds explore (reproducible runs, tests)
    # An exploration from a drafting arm runs a neighbour rated within this share of it, and one in
    # explore_far_every any neighbour: an arm rated far below is measured again seldom. Running every
    # neighbour in turn cost 12% of the rate on emulated h100-8b (agreement 0.95, T = 0: 0.32 tokens/ms
    # against 0.37 without exploring), an off or target-only round breaking the pipeline for the next.
    explore_within: float = 0.15
    explore_far_every: int = 4
    horizon: float = 32.0  # rounds a family's correction averages over
    correction_prior: float = 4.0  # a family's correction is shrunk towards 0 (the model) by this many rounds
    # ... and an arm's towards its family's by this many: how far a pipeline's cycles exceed the model depends
    # on K (spec-cache K = 1 stages nearly every round, K = 2 where the branch call outlasts the verify seldom)
    arm_correction_prior: float = 8.0
    service_prior_weight: float = 2.0  # the 0.5 starting guess counts as this many verdicts service-wide
    # The service's acceptance counts as this many of a request's verdicts: estimated from how much finished
    # requests differed (`RequestSpread`), within these bounds; the first value until a few have finished.
    request_prior_weight: float = 4.0
    request_prior_max: float = 64.0
    start_k: int = 2  # before anything is measured
    probe_z: float = 2.0  # target-only is chosen only if it wins at the service acceptance's Wilson upper bound
    # ... by this share: a probe is one drafting round between target-only ones, dearer than the steady
    # arm it rates (its fresh draft catches up on the tokens since the last; its pre-draft goes unused).
    # Where the cache hides the draft, K = 1 rated level with target-only even at a useless draft's
    # bound: every request's first round probed (emulated h100-tp2-70b, agreement 0, T = 0.7: such a
    # round 30.6 ms against 21.2 target-only, TTFT 36.7 ms against 23.2; auto 0.93x target-only).
    probe_margin: float = 0.1
    probe_margin_after: float = 8.0  # verdicts: before, a cold start's few unlucky ones are all there is
    # One probe at a time per class: the next waits for a verdict, or this many of the class's rounds (a probe
    # whose request ended unanswered). Requests that start together all probed at once (with a useless draft,
    # 32 streams of 8-token requests: auto 0.83-0.85x target-only on emulated h100-8b, 0.94-0.98x after).
    probe_hold: int = 64
    cut_margin: float = 0.01  # a proposal is verified one token longer only for a predicted gain above this
    # Target-only, once chosen, holds for up to this many rounds while no verdict that accepted a token
    # arrives (from any request of its kind): only the costs move meanwhile, slowly, and rating every arm
    # was 0.25 ms of each such round on the coordinator (emulated h100-tp2-70b, agreement 0: auto's rounds
    # 0.5 ms longer).
    target_only_hold: int = 8
    # ... and a new request (no verdict of its own) takes another new request's target-only rating for this
    # many of the class's rounds (every request's: two steps of a 32-stream batch)
    fresh_hold: int = 64
    # A pipeline is chosen over none only for a predicted gain above this share, and only tried where the
    # fresh draft's wait it could hide is at least this share of the cycle: its costs outside the model (an
    # extra draft call, a staged message, the CPU those take on a shared host) are real, and a draft
    # that costs next to nothing (n-gram, suffix) leaves a pipeline nothing to hide.
    pipeline_margin: float = 0.05


class AutoPolicy:
    """The service-wide state every request's `AutoChooser` reads and feeds (one per round loop)."""

    def __init__(self, settings: AutoSettings | None = None) -> None:
        self.settings = settings or AutoSettings()
        self._classes: dict[tuple[bool, int], ArmCycles] = {}
        self._rounds = 0
        self._explorations = 0
        self._coin = random.Random(self.settings.explore_seed)  # which target-only rounds explore

    def workload(self, greedy: bool, running: int) -> ArmCycles:
        """The measurements of a workload class: greedy or sampled, and log2 of the requests running.

        Costs are the class's own (a batched pass costs what its load makes it cost); what the draft's
        proposals are worth is not a matter of load, so the classes of one kind (greedy or sampled) share
        their acceptance, confidence calibration and request spread: a class that opens when the load
        rises starts with every verdict seen at lower loads."""
        key = (greedy, max(0, int(running)).bit_length())
        cls = self._classes.get(key)
        if cls is None:
            kin = next((c for (g, _), c in self._classes.items() if g == greedy), None)
            if kin is not None:
                cls = ArmCycles(acceptance=kin.acceptance, calibration=kin.calibration, spread=kin.spread, key=key)
            else:
                s = self.settings
                spread = RequestSpread(default=s.request_prior_weight, largest=s.request_prior_max)
                cls = ArmCycles(spread=spread, key=key)
            self._classes[key] = cls
        return cls

    def measured_near(self, cls: ArmCycles) -> ArmCycles | None:
        """cls, or where it has measured no call yet, the measured class of its kind nearest in load (None:
        none is): a class that opens rates its arms with a neighbour's costs until it has its own, instead of
        drafting blind (every request of a new load drafting its first round)."""
        if cls.verify_ms.mean() is not None:
            return cls
        greedy, load = cls.key
        near = [(abs(k[1] - load), k[1], c) for k, c in self._classes.items() if k[0] == greedy and c is not cls]
        near = [n for n in near if n[2].verify_ms.mean() is not None]
        return min(near, key=lambda n: (n[0], n[1]))[2] if near else None

    def explore_now(self, every: int) -> bool:
        """Count a round; True once every `every` rounds."""
        self._rounds += 1
        return self._rounds % every == 0

    def explore_by_chance(self, every: int) -> bool:
        """Count a round; True with chance 1 / every (the policy's own seeded coin), at no fixed stride:
        explorations from target-only, whose verdicts are what can end it.

        At a fixed stride the guesses from target-only sampled one phase of a periodic text: the emulator's
        greedy texts (its model reads the last few tokens) cycle, and shadow guesses every 8th token
        matched 0.245 (51 of 208) where the same texts' positions matched 0.39 (630 of 1,616; emulated
        h100-8b, agreement 0.6, T = 0), which held auto target-only. (A golden-ratio sequence instead
        fell on 13 of 24 residues of a period of 24 in 100 explorations: Fibonacci-like gaps.)"""
        self._rounds += 1
        return self._coin.random() * every < 1.0

    def explore_far(self) -> bool:
        """Count an exploration; True once every `explore_far_every`: it may run any neighbour of the best."""
        self._explorations += 1
        return self._explorations % self.settings.explore_far_every == 0

    def chooser(
        self, k_max: int, pipelines: Sequence[str], *, target_only: bool, k_min: int = 1, shadow: bool = False
    ) -> AutoChooser:
        """A request's chooser: K in k_min..k_max (and 0 if target_only) over these pipelines; shadow: the
        request's explorations from target-only are shadow guesses (AutoChooser.choose)."""
        return AutoChooser(self, k_max, tuple(pipelines), target_only, k_min, shadow)


class AutoChooser:
    """One request's arm choice: its own acceptance, the service's measured costs."""

    def __init__(
        self,
        policy: AutoPolicy,
        k_max: int,
        pipelines: tuple[str, ...],
        target_only: bool,
        k_min: int = 1,
        shadow: bool = False,
    ) -> None:
        self.policy = policy
        self.shadow = shadow  # an exploration from target-only is a shadow guess (choose)
        self.shadow_due = False  # the round just chosen fetches the draft's guess beside its verify
        self._matched = False  # a shadow guess was right: the next target-only round explores by drafting
        self.k_max = max(1, k_max)
        self.k_min = min(max(1, k_min), self.k_max)
        self.pipelines = pipelines
        self.target_only = target_only
        self.acceptance = AcceptanceModel(forget=0.97)  # this request's last ~30 verdicts: its text as it is now
        self._arms = [Arm(p, k) for p in pipelines for k in range(self.k_min, self.k_max + 1)]
        if target_only:
            self._arms.append(TARGET_ONLY)
        # A round rates every arm, and the rates and costs they share change only with what is observed:
        # computed once per change (the rating was 0.2 ms of a round's coordinator CPU, emulated h100-8b).
        self._rates: tuple[tuple[int, int, int, float], list[float]] | None = None
        self._costs: tuple[tuple[int, int], _CostTable] | None = None
        self._verdicts = self._accepted = 0.0  # this request's, unforgotten: for its class's RequestSpread
        self._held: tuple[tuple[int, int], int] | None = None  # target-only's hold: (its kind, verdicts), rounds left
        self._cls: ArmCycles | None = None  # the class of its last verdict

    def rates(self, cls: ArmCycles) -> list[float]:
        """This request's acceptance per position 1 .. k_max + 1 (the last: a bonus guess's, at k_max),
        shrunk towards the service's at that position, moved to this request's level."""
        key = (id(cls), cls.acceptance.version, self.acceptance.version, cls.spread.weight())
        if self._rates is None or self._rates[0] != key:
            self._rates = key, self._rates_now(cls)
        return self._rates[1]

    def _rates_now(self, cls: ArmCycles) -> list[float]:
        s = self.policy.settings
        k = self.k_max + 1
        service = cls.acceptance.pooled(0.5, s.service_prior_weight)
        shape = cls.acceptance.rates(k, 0.5, s.service_prior_weight)  # the service's rate per position
        # requests that differ no more than their coins (a large weight) share the service's profile too
        weight = cls.spread.weight()
        return self.acceptance.rates(k, service, weight, shape, position_weight=weight)

    def choose(self, cls: ArmCycles) -> Arm:
        """The arm for the next round (the best, or a neighbour of it on an exploration round)."""
        s = self.policy.settings
        # Target-only holds until a verdict that accepted something (a rejection only argues for it more),
        # whichever class of its kind the load puts the request in: at 32 streams, requests starting and
        # ending moved it between classes, and every verdict re-rated all of them (auto's rounds
        # 0.29-0.31 ms of the coordinator's CPU against target-only's 0.16-0.17; emulated h100-8b, agreement 0).
        key = (id(cls.acceptance), cls.acceptance.accepting)
        fresh = (
            (self.k_min, self.k_max, self.pipelines, self.target_only, *key) if not self.acceptance.verdicts else None
        )
        shared = cls.fresh_target_only
        guess_probe = False  # a probe is due and this request guesses: the round guesses instead of drafting
        if self._held is not None and self._held[0] == key and self._held[1] > 0:
            best, self._held = TARGET_ONLY, (key, self._held[1] - 1)
        elif fresh is not None and shared is not None and shared[0] == fresh and cls.rounds - shared[1] < s.fresh_hold:
            best, self._held = TARGET_ONLY, (key, s.target_only_hold - 1)
        else:
            best, guess_probe = self.best(cls, self.rates(cls))
            # a guessing probe does not hold: its verdict comes with the next round, which may probe again
            self._held = (key, s.target_only_hold - 1) if best == TARGET_ONLY and not guess_probe else None
            if fresh is not None and best == TARGET_ONLY:
                cls.fresh_target_only = (fresh, cls.rounds)
        self.shadow_due = False
        if best.k == 0:
            explore = self.policy.explore_by_chance(s.shadow_every if self.shadow else s.explore_target_only_every)
        else:
            explore = self.policy.explore_now(s.explore_every)
        if best.k == 0 and self._matched:  # a shadow guess was right: explore by drafting now
            explore, self._matched = True, False
        elif (explore or guess_probe) and best.k == 0 and self.shadow:
            # An exploration or a probe from target-only: the round stays target-only and the draft's guess
            # of its token comes beside the verify (RequestRun), a K = 1 verdict (at T > 0 on the low side,
            # see the module docstring) at no wall time. A drafting exploration waited for its draft call:
            # 10.6-14.0 ms against 7.5 a round (emulated h100-8b, agreement 0, T = 0), ~0.8% of the rate
            # at one round in 72. A guess measures no arm's cost, so a right one makes the next round a
            # drafting exploration (observe_shadow).
            self.shadow_due, explore = True, False
        if explore:
            neighbours = self.neighbours(best, cls)
            if best.k > 0 and not self.policy.explore_far():
                neighbours = self._close(cls, best, neighbours)
            if neighbours:
                return min(neighbours, key=lambda a: (cls.last_seen.get(a, -1), a))
        if best.k == 0:
            # No verdict will come from this round: the request's own acceptance still ages, so a bad
            # stretch that stopped it drafting fades towards the service's rate in rounds, not only in
            # the rare exploration verdicts (a request at 0.45 after 4 unlucky tokens, the service at
            # 0.7, stayed target-only for 20 rounds on emulated h100-8b, T = 0.7).
            self.acceptance.age()
        return best

    def _close(self, cls: ArmCycles, best: Arm, arms: list[Arm]) -> list[Arm]:
        """The arms rated within explore_within of the best: the ones it could move to on a measurement."""
        rated = self.rate_arms(cls, [best, *arms], self.rates(cls), runnable=False)
        floor = (1.0 - self.policy.settings.explore_within) * rated[best]
        return [a for a in arms if rated[a] >= floor]

    def best(self, cls: ArmCycles, rates: Sequence[float]) -> tuple[Arm, bool]:
        """The arm with the best expected rate, among K up to one more than any measured yet
        (the cost fits do not extrapolate: a longer K is measured before it is trusted); a pipelined
        arm only if it beats the best without a pipeline by `pipeline_margin`. Where target-only is the best
        but a probe is due (`probe`), the probe; or, for a request that guesses (shadow), target-only and
        True: `choose` makes that round a shadow guess, a verdict at no wall time."""
        start = min(self.k_max, max(self.k_min, self.policy.settings.start_k))
        costs = self.policy.measured_near(cls)
        if costs is None:  # nothing measured yet in this class or any of its kind
            return Arm(self.pipelines[0], start), False
        # `costs` is cls, or its nearest measured neighbour until cls has calls of its own; `rates` (its
        # kind's shared acceptance) serves either. The round itself runs, probes and is measured in cls.
        reach = max(start, costs.longest + 1, self.k_min)
        rated = self.rate_arms(costs, [a for a in self._arms if a.k <= reach], rates)
        best = max(rated, key=lambda a: (rated[a], -a.k))
        plain = [a for a in rated if a.pipeline == OFF or a.k == 0]
        if best.pipeline != OFF and best.k > 0 and plain:
            unpiped = max(plain, key=lambda a: (rated[a], -a.k))
            if rated[best] <= rated[unpiped] * (1.0 + self.policy.settings.pipeline_margin):
                best = unpiped
        if best.k == 0:
            # also where a pipelined arm rated above target-only but within the margin: that fell back
            # to target-only without a probe, and a request whose few verdicts were unlucky stayed there
            probe = self.probe(costs, rated[best], cls)
            if probe is not None:
                return (best, True) if self.shadow else (probe, False)
        return best, False

    def probe(self, cls: ArmCycles, target_only_rate: float, gate: ArmCycles) -> Arm | None:
        """The drafting arm to run instead of target-only while the service's acceptance is too uncertain to
        rule drafting out: the best of target-only's neighbours (K = k_min) with the service's rate at its
        Wilson upper bound (`probe_z`) as this request's prior (its own verdicts as they are), if that
        beats target-only; else None.

        A target-only round brings no verdict, so an estimate that fell below break-even on a few unlucky
        verdicts would stay there (the service at 0.25 after two rejections, with 0.72 true, stayed
        target-only for 160 rounds on emulated h100-8b, T = 0.7). Each probe adds verdicts, so the bound
        closes: with a useless draft it falls under a K = 1 round's break-even within a few verdicts, and
        no verdict is forgotten while none come. K itself is still chosen at the plain estimate.

        One probe at a time per class (`gate`, the class the round runs in; `AutoSettings.probe_hold`): the
        next waits for a verdict, so requests that start together do not all draft to learn one thing."""
        s = self.policy.settings
        if not gate.may_probe(s.probe_hold):
            return None
        seen = sum(cls.acceptance.reached)
        trials = seen + s.service_prior_weight
        prior = upper_bound(cls.acceptance.pooled(0.5, s.service_prior_weight), trials, s.probe_z)
        # target-only's neighbours read positions 1 .. k_min + 1 (the last: a bonus guess's)
        optimistic = self.acceptance.rates(self.k_min + 1, prior, cls.spread.weight())
        rated = self.rate_arms(cls, [Arm(pipeline, self.k_min) for pipeline in self.pipelines], optimistic)
        if not rated:
            return None
        arm = max(rated, key=lambda a: (rated[a], -a.k))
        margin = s.probe_margin if seen >= s.probe_margin_after else 0.0
        if rated[arm] <= target_only_rate * (1.0 + margin):
            return None
        gate.probed()
        return arm

    def _may_run(self, cls: ArmCycles, arm: Arm) -> bool:
        """False for a pipelined arm that cannot gain pipeline_margin, where running without one is allowed:
        a pipeline hides at most the fresh draft's wait d(K), so a draft that costs less than that share of
        the cycle (n-gram, suffix) leaves it nothing worth its own costs."""
        if arm.k == 0 or arm.pipeline == OFF or OFF not in self.pipelines:
            return True
        costs = self._cost_table(cls)
        verify, draft = costs.verify[arm.k + 1], costs.draft[arm.k]
        return draft >= self.policy.settings.pipeline_margin * (verify + draft)

    def rate_arms(
        self, cls: ArmCycles, arms: Sequence[Arm], rates: Sequence[float], *, runnable: bool = True
    ) -> dict[Arm, float]:
        """Tokens per ms each arm is expected to give (of those `_may_run` allows, if runnable):
        arm_tokens / max(model_cycle + correction, 0), with what the arms share computed once: the
        tokens and P(all accepted) per K, the cost table, and each pipeline's measured hits and
        corrections. Rating every arm one by one was 0.34 ms of CPU a round in the coordinator,
        60% of auto's (emulated h100-8b, agreement 0.8, T = 0, k_max 6)."""
        costs = self._cost_table(cls)
        s = self.policy.settings
        # E[tokens | K] and P(all K accepted), as expected_tokens and all_accepted compute them
        tokens, p_all = [1.0], [1.0]
        for a in rates:
            p_all.append(p_all[-1] * a)
            tokens.append(tokens[-1] + p_all[-1])
        last = len(rates)
        family: dict[str, float] = {}  # family -> its measured correction
        pre_excess: dict[str, float] = {}  # pipeline -> its pre-draft's measured excess
        rejected_hit: dict[str, float] = {}  # pipeline -> P(hit | a rejection), shrunk
        out: dict[Arm, float] = {}
        for arm in arms:
            k, pipeline = arm.k, arm.pipeline
            fam = _family(arm)
            if fam not in family:
                family[fam] = self._correction(cls.residual_ms.get(fam))
            correction = family[fam]
            if k == 0:
                out[arm] = 1.0 / max(max(0.0, (_predict(cls.verify_ms, 1) or 0.0) + correction), 1e-6)
                continue
            verify, draft = costs.verify[k + 1], costs.draft[k]
            if runnable and pipeline != OFF and OFF in self.pipelines and draft < s.pipeline_margin * (verify + draft):
                continue  # _may_run
            n = min(k, last)
            if pipeline == OFF:
                cycle = verify + draft
            else:
                if pipeline not in pre_excess:
                    pre_excess[pipeline] = self._correction(cls.pre_draft_excess_ms.get(pipeline))
                    rejected_hit[pipeline] = self._shrunk(
                        cls.hits.get((pipeline, False)), prior_hits(pipeline, (), 0)[1]
                    )
                stands_for = draft if pipeline == POST_VERIFY else costs.pre_draft[k]
                pre = max(0.0, stands_for + pre_excess[pipeline])
                h_all = self._shrunk(cls.hits.get((pipeline, True)), prior_hits(pipeline, rates, k)[0])
                hit = p_all[n] * h_all + (1.0 - p_all[n]) * rejected_hit[pipeline]
                cycle = waited(pipeline, verify, draft, pre, hit)
                own = cls.arm_residual_ms.get(arm)
                if own is not None:
                    w = s.arm_correction_prior
                    correction = (own.value * own.weight + correction * w) / (own.weight + w)
            expected = tokens[n] - (p_all[n] if pipeline == POST_VERIFY else 0.0)
            out[arm] = expected / max(max(0.0, cycle + correction), 1e-6)
        return out

    def hit(self, cls: ArmCycles, arm: Arm, rates: Sequence[float]) -> float:
        """The arm's chance of a pipeline hit: the model's, corrected by what its pipeline measured."""
        if arm.k == 0 or arm.pipeline == OFF:
            return 0.0
        prior = prior_hits(arm.pipeline, rates, arm.k)
        given = tuple(
            self._shrunk(cls.hits.get((arm.pipeline, all_in)), prior[i]) for i, all_in in enumerate((True, False))
        )
        return hit_chance(arm.pipeline, rates, arm.k, (given[0], given[1]))

    def _shrunk(self, measured: Estimate | None, prior: float) -> float:
        """A measured rate shrunk towards its prior by correction_prior rounds."""
        if measured is None:
            return prior
        w = self.policy.settings.correction_prior
        return (measured.value * measured.weight + prior * w) / (measured.weight + w)

    def _correction(self, measured: Estimate | None) -> float:
        """A measured correction shrunk towards none: one unlucky round does not condemn a pipeline."""
        if measured is None:
            return 0.0
        return measured.value * measured.weight / (measured.weight + self.policy.settings.correction_prior)

    def model_cycle(self, cls: ArmCycles, arm: Arm, rates: Sequence[float]) -> float:
        """The cycle in ms before its family's measured correction (see `waited`)."""
        if arm.k == 0:  # v(1) alone: not the whole table, which every call observed changes
            return _predict(cls.verify_ms, 1) or 0.0
        costs = self._cost_table(cls)
        verify = costs.verify[arm.k + 1]
        pre = self.pre_draft(cls, arm.pipeline, arm.k)
        return waited(arm.pipeline, verify, costs.draft[arm.k], pre, self.hit(cls, arm, rates))

    def pre_draft(self, cls: ArmCycles, pipeline: str, k: int) -> float:
        """pre_p(K): the pipeline's pre-draft call as the next round waits for it, in ms: the fresh draft it
        stands for (d(K + 1) from a guessed bonus, d(K) for post-verify's, which starts at the deferred
        bonus) plus what the pipeline's calls measured beyond that, shrunk towards none.

        A branch call drafts K + 1 tokens for several verdicts at once: its rows' host work makes it
        longer than a fresh draft of K + 1 (emulated h100-8b, K = 4, agreement 0.95, T = 0: 10.7 ms
        against 9.0), and at a K whose pre-draft already outlasts the verify that decides the
        cycle: speccache-4 gave 2.9x target-only where bonus-match's pipelined-4 gave 3.4x, and
        auto, rating both pre-drafts at d(K + 1), ran spec-cache."""
        return max(0.0, self._stands_for(cls, pipeline, k) + self._correction(cls.pre_draft_excess_ms.get(pipeline)))

    def _stands_for(self, cls: ArmCycles, pipeline: str, k: int) -> float:
        """The fresh draft a pipeline's pre-draft for a next round of k tokens stands for: d(k + 1), or d(k)
        for post-verify's."""
        costs = self._cost_table(cls, k)
        return costs.draft[k] if pipeline == POST_VERIFY else costs.pre_draft[k]

    def _cost_table(self, cls: ArmCycles, k_top: int = 0) -> _CostTable:
        """v(K + 1), d(K) and d(K + 1) for every K the chooser rates (and up to k_top), as `cls` measured them now."""
        key = (id(cls), cls.version)
        k_top = max(self.k_max, k_top)
        if self._costs is None or self._costs[0] != key or len(self._costs[1].draft) < k_top + 2:
            ks = range(k_top + 2)
            verify = [_predict(cls.verify_ms, k) or 0.0 for k in range(k_top + 3)]
            draft = [self._draft_ms(cls, k, verify[k + 1]) for k in ks]
            pre_draft = [self._draft_ms(cls, k + 1, verify[k + 1]) for k in ks]
            self._costs = key, _CostTable(verify, draft, pre_draft)
        return self._costs[1]

    @staticmethod
    def _draft_ms(cls: ArmCycles, k: int, verify: float) -> float:
        """d(k): the call's hops plus its compute, fitted; before the slope is known, the compute
        proportional to the steps (a draft step per token)."""
        if cls.draft_ms.fit() is not None:
            return cls.draft_hops_ms.value + (_predict(cls.draft_ms, k) or 0.0)
        mean, tokens = cls.draft_ms.mean(), cls.draft_ms.mean_tokens()
        if mean is None or not tokens:
            return 0.2 * verify * k  # unmeasured: a cheap-ish draft
        return cls.draft_hops_ms.value + mean * k / tokens

    def correction(self, cls: ArmCycles, arm: Arm) -> float:
        """What the arm's cycles exceeded their model by: a pipelined arm's own rounds' excess, shrunk towards
        its pipeline's, which is shrunk towards none; other arms take their family's (off's, target-only's).

        Per arm only where a pipeline runs: how much of a pre-draft the verify hides and how often a round
        stages depend on K in ways the model does not follow. Without a pipeline v(K + 1) + d(K) does,
        and per-arm excesses there cost the suffix drafter on the repetitive set (real demo target, CPU)
        1.45-1.70x target-only against 2.00-2.05x: an arm of K = 16 whose proposals the cut shortens
        reads a cycle its K never had."""
        family = self._correction(cls.residual_ms.get(_family(arm)))
        own = cls.arm_residual_ms.get(arm) if arm.k > 0 and arm.pipeline != OFF else None
        if own is None:  # target-only, and rounds without a pipeline: v(K + 1) + d(K) already follows K
            return family
        w = self.policy.settings.arm_correction_prior
        return (own.value * own.weight + family * w) / (own.weight + w)

    def neighbours(self, arm: Arm, cls: ArmCycles | None = None) -> list[Arm]:
        """The arms the best could move to next: K +- 1, the other pipelines at K, target-only
        (with cls: only those `_may_run` allows)."""
        if arm.k == 0:
            out = [Arm(p, self.k_min) for p in self.pipelines]
        else:
            out = [Arm(arm.pipeline, k) for k in (arm.k - 1, arm.k + 1) if self.k_min <= k <= self.k_max]
            out += [Arm(p, arm.k) for p in self.pipelines if p != arm.pipeline]
            if self.target_only:
                out.append(TARGET_ONLY)
        return out if cls is None else [a for a in out if self._may_run(cls, a)]

    def cut(self, cls: ArmCycles, arm: Arm, confidence: Sequence[float]) -> int:
        """How many of a proposal's tokens to verify: the n >= 1 with the best expected rate.

        The draft is paid for; what one more verified token still costs is its
        share of the verify (v(n + 2) - v(n + 1)), and what it is worth is
        P(it and those before it accepted), from the calibrated confidences. For a
        pipeline that needs every token accepted, a shorter proposal also hits more;
        its pre-draft is the arm's whatever n (the next round asks for K again):
        rated at n, it favoured cuts that verified less and waited as long (emulated
        h100-8b, agreement 0.95, T = 0: 23% of K = 3 proposals cut, 3.32 tokens a
        round against 3.52 uncut at the same wall).
        Exact: which tokens are verified depends on the draft alone (as when it
        drafts fewer), never on the target's coins."""
        n = len(confidence)
        if n <= 1 or arm.k == 0:
            return n
        s = self.policy.settings
        rates = self.calibrated(cls, confidence)
        costs = self._cost_table(cls, max(n, arm.k))
        draft = costs.draft[arm.k]
        pre = self.pre_draft(cls, arm.pipeline, arm.k)
        residual = self.correction(cls, arm)
        best_n, best_rate = n, -1.0
        for i in range(1, n + 1):
            hit = self.hit(cls, Arm(arm.pipeline, i), rates)
            cycle = waited(arm.pipeline, costs.verify[i + 1], draft, pre, hit) + residual
            rate = arm_tokens(Arm(arm.pipeline, i), rates) / max(cycle, 1e-6)
            if rate > best_rate * (1.0 + s.cut_margin):  # a longer proposal must pay clearly
                best_n, best_rate = i, rate
        return best_n

    def calibrated(self, cls: ArmCycles, confidence: Sequence[float]) -> list[float]:
        """The tokens' acceptance: this request's rate at each position (`rates`), moved in log-odds by how
        far the token's confidence bin measured above or below the calibration's pooled rate.

        A confidence that says nothing (a suffix match's: 1.0 on nearly every token) leaves the position
        profile as it is. The bins alone rated every such token at the pooled rate (0.8), so the cut
        dropped deep tokens that the repetitive set accepts at 0.85-0.9 once the ones before were."""
        prior = self.acceptance.pooled(cls.acceptance.pooled(0.5, 2.0), cls.spread.weight())
        bins = cls.calibration.calibrated(confidence, prior)
        level = _logit(cls.calibration.pooled(prior))
        positions = self.rates(cls)
        return [
            _expit(_logit(positions[min(i, len(positions) - 1)]) + _logit(rate) - level) for i, rate in enumerate(bins)
        ]

    # ---- what rounds report -----------------------------------------------------

    def observe_verdict(self, cls: ArmCycles, drafted: int, accepted: int, confidence: Sequence[float] = ()) -> None:
        """A verdict: `accepted` of the `drafted` tokens asked for; confidence: of the tokens verified."""
        if drafted > 0:
            self._verdicts += min(drafted, accepted + 1)  # the positions reached, as AcceptanceModel counts them
            self._accepted += min(drafted, accepted)
            self._cls = cls
        self.acceptance.observe(drafted, accepted)
        cls.acceptance.observe(drafted, accepted)
        cls.calibration.observe(confidence, accepted)

    def observe_shadow(self, cls: ArmCycles, matched: bool, confidence: Sequence[float] = ()) -> None:
        """A shadow guess (choose): the draft's guess of a token a target-only round committed (its argmax
        at T = 0, drawn at the target's coin at T > 0), and whether it was that token: a K = 1 verdict
        (exact at T = 0, a little low at T > 0: the module docstring); its costs are not a round's."""
        self.observe_verdict(cls, 1, int(matched), confidence[:1])
        self._matched = self._matched or matched

    def finish(self) -> None:
        """The request ended: its acceptance joins its class's spread of requests."""
        if self._cls is not None:
            self._cls.spread.observe(self._verdicts, self._accepted)
            self._cls = None

    def observe_cycle(self, cls: ArmCycles, arm: Arm, cycle_ms: float, hit: bool = False, all_in: bool = False) -> None:
        """A round of `arm` took cycle_ms (its verify out to the next verify out); hit: the next
        round drafted nothing itself, it used this round's pre-draft; all_in: every draft was accepted."""
        if not cycle_ms > 0:
            return
        horizon = self.policy.settings.horizon
        cls.rounds += 1
        cls.last_seen[arm] = cls.rounds
        structural = _STRUCTURAL.get(arm.pipeline, (True, True))
        if arm.k > 0 and arm.pipeline != OFF and structural[0 if all_in else 1]:
            measured = cls.hits.setdefault((arm.pipeline, all_in), Estimate(0.0))
            measured.update(float(hit), horizon=horizon)
        excess = cycle_ms - self.model_cycle(cls, arm, self.rates(cls) if arm.k else ())  # target-only's: no rates
        cls.residual_ms.setdefault(_family(arm), Estimate(0.0)).update(excess, horizon=horizon)
        cls.arm_residual_ms.setdefault(arm, Estimate(0.0)).update(excess, horizon=horizon)

    def observe_round(
        self,
        cls: ArmCycles,
        arm: Arm,
        proposal: Proposal,
        drafted: int,
        pre_drafted: bool,
        accepted: int,
        verify_ms: float,
        draft_wall_ms: float,
    ) -> None:
        """A round's verdict and call walls. drafted: the tokens its fresh draft call drafted
        (before a cut); pre_drafted: its proposal came from the previous round's pipeline.

        A fresh draft that came back short counts its missing positions as rejected: what the arm
        yields is what the drafter gives when K is asked for. The tokens the cut dropped were never
        verified: they say nothing of acceptance. Counted as rejected (as before), a cut after n
        tokens all accepted read as a rejection at position n + 1, which made the next cut come
        earlier: on emulated h100-8b (agreement 0.95, T = 0.7) auto's rates at positions 3-4 sank
        to 0.84 where pipelined-4's verdicts measured 0.95, and auto ran mostly K = 2."""
        cut = 0 < len(proposal) < drafted and not pre_drafted
        asked = len(proposal) if pre_drafted or arm == TARGET_ONLY or cut else arm.k
        if asked > 0:
            self.observe_verdict(cls, asked, accepted, proposal.confidence)
        fresh = drafted if draft_wall_ms > 0 else 0
        # A fresh draft that waited in the draft service's queue behind this request's own pre-draft
        # (a pipeline's miss) measures that wait, not a draft's cost: the cycle model already waits
        # for the pre-draft (max(v, pre)), so d(K) is fitted without it.
        queued = proposal.transit.queue_ms if proposal.transit is not None else 0.0
        wall = max(draft_wall_ms - queued, 0.0)
        self.observe_calls(cls, arm, len(proposal) + 1, verify_ms, fresh, wall, proposal.compute_ms)

    def observe_pre_draft(self, cls: ArmCycles, pipeline: str, k: int, wall_ms: float) -> None:
        """A pipeline's pre-draft call for a next round of k draft tokens answered wall_ms after it went out."""
        if pipeline == OFF or k <= 0 or not wall_ms > 0:
            return
        excess = cls.pre_draft_excess_ms.setdefault(pipeline, Estimate(0.0))
        excess.update(wall_ms - self._stands_for(cls, pipeline, k), horizon=self.policy.settings.horizon)

    def observe_calls(
        self,
        cls: ArmCycles,
        arm: Arm,
        tokens: int,
        verify_ms: float,
        drafted: int,
        draft_ms: float,
        draft_compute_ms: float = 0.0,
    ) -> None:
        """The round's verify call (tokens verified, wall) and fresh draft call (tokens drafted, wall less
        its queue, and the draft's own compute within it; drafted 0: none)."""
        cls.version += 1
        cls.verify_ms.observe(tokens, verify_ms)
        cls.longest = max(cls.longest, arm.k)
        if drafted > 0 and draft_ms > 0:
            compute = draft_compute_ms if 0.0 < draft_compute_ms <= draft_ms else draft_ms
            cls.draft_ms.observe(drafted, compute)
            cls.draft_hops_ms.update(draft_ms - compute, horizon=self.policy.settings.horizon)
