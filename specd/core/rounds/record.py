"""What a round did, once: the immutable `RoundRecord`, and the sums over a request's records.

Every consumer of a round's numbers reads them from here: the request's
`RoundStats` (added up from records), the round span's attributes
(specd.serving.trace_spans.round_attributes) and the metrics
(specd.serving.metrics.CoordinatorMetrics.observe_round).

Words are vLLM's: *drafts* are rounds that verified >= 1 draft token,
*accepted* draft tokens, and the one extra token a verdict adds is
*recovered* (drawn at the first rejection), *bonus* (every draft accepted)
or *deferred* (every draft accepted, the bonus position left to the next
round's first draft token: post-verify pipelining).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from specd.core.transit import Transit


class TokenKind(enum.Enum):
    RECOVERED = "recovered"
    BONUS = "bonus"
    DEFERRED = "deferred"


class TargetOnly(enum.Enum):
    """Why a round verified no draft tokens."""

    SPECULATION_OFF = "speculation_off"  # the request asked for no speculation
    ADAPTIVE = "adaptive"  # automatic K chose none this round: speculating does not pay now
    BUDGET = "budget"  # max_new_tokens or the context leave no room for a draft token
    NO_DRAFT = "no_draft"  # no draft is configured
    DRAFT_UNAVAILABLE = "draft_unavailable"  # the draft is down, incompatible, or paused after a failure
    DRAFT_FAILED = "draft_failed"  # this round's propose failed (slow, gone, lying, full)
    DRAFT_REFUSED = "draft_refused"  # the draft refused this request alone (its own error, or full for it)
    DRAFT_DEADLINE = "draft_deadline"  # the request's own deadline ran out before the draft answered
    DRAFT_EMPTY = "draft_empty"  # the draft had nothing to propose (e.g. no n-gram match)
    # A speculating request's first round (LoopSettings.opening "beside"): the target prefilled the prompt
    # alone while the draft's first call ran beside it, after its guess of the first token (RequestRun._opens_beside)
    OPENING = "opening"

    @property
    def fallback(self) -> bool:
        """The round wanted draft tokens but got none (the `target_only` of stats, spans and metrics)."""
        return self in _FALLBACKS


_FALLBACKS = frozenset(
    {
        TargetOnly.NO_DRAFT,
        TargetOnly.DRAFT_UNAVAILABLE,
        TargetOnly.DRAFT_FAILED,
        TargetOnly.DRAFT_EMPTY,
        TargetOnly.DRAFT_DEADLINE,
    }
)


@dataclass(frozen=True)
class PipelineHit:
    """A round whose draft tokens were drafted during the previous round's verify."""

    strategy: str  # the pipeline strategy's name
    accepted: int  # the previous round's outcome the pre-draft was made for: its accepted count ...
    kind: TokenKind  # ... and the kind of its extra token
    launched: int  # pre-drafts the strategy launched for that outcome and others (spec-cache: the branch budget)

    @property
    def outcome(self) -> str:
        """'accepted:kind', e.g. '4:bonus': the key of per-outcome hit counts."""
        return f"{self.accepted}:{self.kind.value}"


@dataclass(frozen=True)
class RoundRecord:
    """One round, after it committed. Timings in ms; draft/verify compute as the peers report it."""

    index: int  # 0-based within the request
    committed_length: int  # tokens committed before the round
    draft_length: int  # K asked of the draft after the budget (0: target-only)
    draft_token_ids: tuple[int, ...]  # the proposal verified
    accepted: int  # draft tokens accepted
    token_id: int  # the recovered or bonus token; -1 when deferred
    token_kind: TokenKind
    committed: tuple[int, ...]  # tokens committed by this round (after stop tokens, limits, stop strings)
    wall_ms: float  # the round at the loop, start to commit
    draft_ms: float  # draft compute of the proposal (0 when it was pre-drafted: hidden)
    verify_ms: float  # target compute of the verdict
    target_only: TargetOnly | None = None  # why no draft tokens were verified; None when some were
    pipeline_hit: PipelineHit | None = None  # the proposal came from the previous round's pre-draft
    pipeline_launched: int = 0  # pre-drafts this round launched for the next (spec-cache: the branch budget)
    pipeline: str = "off"  # the pipeline strategy this round ran (auto picks it per round)
    draft_transit: Transit | None = None  # hops of this round's propose call (None: none made, or in-process)
    verify_transit: Transit | None = None  # hops of its verify call
    staged: bool = False  # the target verified this round's pre-draft itself, staged during the previous round

    @property
    def draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def tokens(self) -> int:
        return len(self.committed)

    @property
    def overhead_ms(self) -> float:
        """Wall time minus both peers' compute: network, queues, the loop itself."""
        return self.wall_ms - self.draft_ms - self.verify_ms

    @property
    def loop_ms(self) -> float | None:
        """The caller's own part of the overhead: what the calls' hops leave unexplained (the loop,
        message building and parsing, waiting for a pre-draft); None without hops."""
        if self.verify_transit is None:
            return None
        hops = self.verify_transit.total_ms + (self.draft_transit.total_ms if self.draft_transit else 0.0)
        return max(0.0, self.overhead_ms - hops)

    @property
    def fallback(self) -> bool:
        """Wanted draft tokens, got none (draft down, failing, incompatible, empty)."""
        return self.target_only is not None and self.target_only.fallback


@dataclass
class RoundStats:
    """A request's rounds added up; `add` is the only writer."""

    rounds: int = 0  # rounds run (each commits >= 1 token)
    drafts: int = 0  # rounds that verified >= 1 draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # draft tokens accepted
    target_only_rounds: int = 0  # rounds that wanted draft tokens but got none
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = rounds whose draft i was accepted
    pipeline_hits: int = 0  # rounds whose drafts were made while the previous round was verified
    pipeline_hits_by_outcome: Counter[str] = field(default_factory=Counter)  # PipelineHit.outcome -> rounds
    staged_rounds: int = 0  # pipeline hits the target verified by itself (staged during the round before)
    target_only_by_reason: Counter[str] = field(default_factory=Counter)  # TargetOnly value -> rounds
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens committed per speculative round."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def overhead_ms(self) -> float:
        return self.wall_ms - self.draft_ms - self.verify_ms

    def add(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.wall_ms += r.wall_ms
        self.draft_ms += r.draft_ms
        self.verify_ms += r.verify_ms
        if r.target_only is not None:
            self.target_only_by_reason[r.target_only.value] += 1
            self.target_only_rounds += int(r.fallback)
        if r.pipeline_hit is not None:
            self.pipeline_hits += 1
            self.pipeline_hits_by_outcome[r.pipeline_hit.outcome] += 1
        self.staged_rounds += r.staged
        k = r.draft_tokens
        if k == 0:
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += r.accepted
        n = min(k, r.draft_length or k)  # positions: a chain's k tokens, a tree's depth (its k nodes are wider)
        if len(self.accepted_per_position) < n:
            self.accepted_per_position.extend([0] * (n - len(self.accepted_per_position)))
        for i in range(r.accepted):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class RequestStats:
    """A finished request: its rounds' sums and its latencies (what GenerateStats carries)."""

    rounds: RoundStats
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    tokens_per_s: float
    seed: int

    @property
    def draft_ms(self) -> float:
        return self.rounds.draft_ms

    @property
    def verify_ms(self) -> float:
        return self.rounds.verify_ms

    @property
    def overhead_ms(self) -> float:
        return self.rounds.overhead_ms
