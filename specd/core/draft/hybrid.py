"""Hybrid drafting: a suffix proposal when it is likely to pay, a draft model's otherwise.

Each round the session's suffix candidate (specd.core.draft.suffix) is scored by
its expected number of accepted tokens (the sum of its estimated
probabilities). When the score reaches `threshold` the round proposes it:
it costs no forward pass, and when it matches, it matches long. Otherwise
the draft model drafts, with its own K: the drafter keeps an acceptance
estimate per source (suffix, model), learnt from what the next round says
was committed, and a cost ratio for the model (its time per token against
the time the target took between two of the session's rounds), and asks
the model for the K in [1, K asked] that maximises Leviathan's S(K); when
no K pays, the round proposes the suffix candidate if there is one (or
nothing), and the model is probed again now and then (ProbeBudget).
With adaptive_k off the model drafts the K asked for whenever the suffix
score is under the threshold: the choices then depend on the tokens only
(what seeded-equality tests need), not on measured times.

Each proposal is of one source: the suffix's one-hot (no q), the model's
with the q it sampled from, so every round is exact as that drafter's is.
The model's session follows the committed prefix lazily: a round that the
suffix drafted leaves it where it was, and its next draft syncs it (the
KV cache rolled back to the longest common prefix, then extended).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specd.core.draft.protocol import Drafter, propose_one
from specd.core.draft.suffix import SuffixSession, SuffixSettings, best_candidate
from specd.core.draft.tenant_index import NO_TENANT
from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.model.pool import SessionTable
from specd.core.rounds.adaptive import Estimate, ProbeBudget, best_draft_length
from specd.core.rounds.steps import ProposeRequest, check_num_tokens
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams

SUFFIX, MODEL = "suffix", "model"


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (slice compares run in C; a binary search on the rest)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Last:
    """A session's previous proposal: where it started and what it said."""

    source: str
    at: int  # committed length it was drafted after
    tokens: list[int]


@dataclass
class _HybridSession:
    suffix: SuffixSession
    model_tokens: list[int]  # what the model drafter's session holds: a committed prefix and its drafts
    last: _Last | None = None
    last_end: float | None = None  # time.perf_counter() when the previous proposal was handed back


@dataclass
class SourceStats:
    """Service-wide estimates the per-source K is chosen from."""

    acceptance: dict[str, Estimate] = field(
        default_factory=lambda: {SUFFIX: Estimate(0.5, 1.0), MODEL: Estimate(0.5, 1.0)}
    )
    model_ms_per_token: Estimate = field(default_factory=lambda: Estimate(0.0))
    round_ms: Estimate = field(default_factory=lambda: Estimate(0.0))  # target verify + overhead, seen from here
    proposals: dict[str, int] = field(default_factory=lambda: {SUFFIX: 0, MODEL: 0, "none": 0})

    @property
    def model_cost_ratio(self) -> float:
        if self.round_ms.weight <= 0 or self.round_ms.value <= 0:
            return 0.0  # nothing seen yet: assume the model is cheap until measured
        return self.model_ms_per_token.value / self.round_ms.value


class HybridDrafter:
    """A draft model plus suffix speculation, chosen per round (see the module doc)."""

    kind = "hybrid"

    def __init__(
        self,
        model: Drafter,
        settings: SuffixSettings | None = None,
        *,
        threshold: float = 1.0,
        adaptive_k: bool = True,
        max_sessions: int = 256,
        idle_timeout_s: float = 600.0,
    ) -> None:
        if threshold < 0:
            raise InvalidArgument(f"the hybrid threshold must be >= 0 (got {threshold})")
        self.model = model
        self.settings = settings or SuffixSettings()
        self.settings.validate()
        self.vocab_size = model.vocab_size
        self.threshold = threshold
        self.adaptive_k = adaptive_k  # False: the model drafts the K asked for (deterministic choices)
        self.learned = self.settings.new_learned()
        self.stats = SourceStats()
        self._probes = ProbeBudget()
        self._sessions: SessionTable[_HybridSession] = SessionTable(
            max_sessions, idle_timeout_s=idle_timeout_s, on_evict=lambda _sid, s: self._learn(s)
        )

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = NO_TENANT,
        confidence: bool = True,
    ) -> None:
        self.model.open(session_id, token_ids, params, wire_top_k, confidence=confidence)  # validates prompt, settings
        tokens = [int(t) for t in token_ids]
        self._sessions.pop(session_id)
        self._sessions.put(session_id, _HybridSession(SuffixSession(tokens, self.settings, tenant), list(tokens)))

    def finish(self, session_id: str, committed_length: int, start: int, tail: Sequence[int]) -> None:
        """The session's final committed tokens, for its tenant's learned index (the close learns them)."""
        if session_id not in self._sessions:
            return
        s = self._sessions.get(session_id)
        try:
            s.suffix.sync(committed_length, start, tail)
        except SessionOutOfSync:
            pass  # learn what it holds: the tokens as of its last message

    def close(self, session_id: str) -> None:
        self.model.close(session_id)
        session = self._sessions.pop(session_id)
        if session is not None:
            self._learn(session)

    def active_sessions(self) -> int:
        return len(self._sessions)

    def propose(self, request: ProposeRequest) -> Proposal:
        return propose_one(self, request)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """Suffix proposals at once; the sessions that need the model share one batched model step."""
        results: list[Proposal | Exception | None] = [None] * len(requests)
        to_model: list[tuple[int, _HybridSession, ProposeRequest]] = []
        for i, req in enumerate(requests):
            try:
                check_num_tokens(req.num_tokens)
                t0 = time.perf_counter()
                s = self._sessions.get(req.session_id)
                s.suffix.sync(req.committed_length, req.start, req.tail)
                self._observe_previous(s, t0)
                candidate, _ = best_candidate(s.suffix, self.learned, self.settings, req.num_tokens)
                confident = len(candidate) > 0 and candidate.score >= self.threshold
                k_model = 0 if confident else self._model_k(req.num_tokens)
                if len(candidate) and k_model == 0:
                    results[i] = self._use(s, SUFFIX, list(candidate.token_ids), (time.perf_counter() - t0) * 1e3)
                elif k_model > 0:
                    prefix = s.suffix.tokens[: s.suffix.committed]
                    start_m = common_prefix_length(s.model_tokens, prefix)
                    to_model.append(
                        (
                            i,
                            s,
                            ProposeRequest(
                                req.session_id, len(prefix), start_m, prefix[start_m:], k_model, req.guess_bonus
                            ),
                        )
                    )
                else:
                    results[i] = self._use(s, "none", [], (time.perf_counter() - t0) * 1e3)
            except Exception as exc:  # noqa: BLE001 - this request's error, reported in its slot
                results[i] = exc
        if to_model:
            drafted = self.model.propose_batch([r for _, _, r in to_model])
            for (i, s, _), proposal in zip(to_model, drafted):
                if isinstance(proposal, BaseException):
                    s.model_tokens = []  # its state is unknown: the next model draft syncs from the start
                    results[i] = proposal
                    continue
                s.model_tokens = s.suffix.tokens[: s.suffix.committed] + list(proposal.token_ids)
                if len(proposal):
                    self.stats.model_ms_per_token.update(proposal.compute_ms / len(proposal))
                self._use(s, MODEL, list(proposal.token_ids), proposal.compute_ms)
                results[i] = proposal
        return [r if r is not None else RuntimeError("not drafted") for r in results]

    def _use(self, s: _HybridSession, source: str, tokens: list[int], compute_ms: float) -> Proposal:
        """Record the round's proposal (its tokens join the session's sequence) and hand it back."""
        self.stats.proposals[source] += 1
        s.suffix.propose(tokens)
        s.last = _Last(source, s.suffix.committed, tokens) if tokens else None
        s.last_end = time.perf_counter()
        return Proposal(tokens, compute_ms=compute_ms)

    def _observe_previous(self, s: _HybridSession, now: float) -> None:
        """Learn from what was committed after the previous proposal: its source's acceptance, the round time."""
        last = s.last
        if last is not None:
            seen = s.suffix.tokens[last.at : s.suffix.committed]
            accepted = common_prefix_length(last.tokens, seen)
            if accepted < len(seen) or accepted == len(last.tokens):  # a rejection seen, or all accepted
                trials = accepted + (0 if accepted == len(last.tokens) else 1)
                self.stats.acceptance[last.source].update(accepted / trials, n=trials)
            if s.last_end is not None:
                self.stats.round_ms.update((now - s.last_end) * 1e3)
        s.last = None

    def _model_k(self, k_max: int) -> int:
        """The model's K: the best S(K) for its acceptance and cost, 0 when none pays (probing now and then)."""
        if not self.adaptive_k:
            return k_max
        k = best_draft_length(self.stats.acceptance[MODEL].value, self.stats.model_cost_ratio, k_max)
        if k > 0:
            self._probes.speculating()
            return k
        return 1 if self._probes.round_off() else 0

    def _learn(self, s: _HybridSession) -> None:
        self.learned.learn(s.suffix.tenant, s.suffix.document(self.settings.prompt_tail))
