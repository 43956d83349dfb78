"""Suffix speculation: draft from what the service has seen, in this request and in earlier ones.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; vLLM `method: suffix`).
Two indexes answer each round (specd.core.draft.suffix_index):

- the session's own: its prompt and the tokens committed so far (anchor 1,
  like the n-gram drafter's prompt lookup);
- the learned one, its tenant's: the outputs of the tenant's finished
  sessions (each with the last `prompt_tail` tokens of its prompt, so that the
  start of an answer can be matched too), bounded in bytes, oldest evicted
  first. What one tenant's sessions taught is never proposed to another's
  (specd.core.draft.tenant_index), unless sharing is "shared".

Each round both are asked for the best continuation of the committed
prefix's last max_depth tokens, and the higher score proposes (the session's
own on a tie). No model and no q: proposals are one-hot, which the sampler
treats exactly, like the n-gram drafter's. When neither index has a
continuation that clears min_token_prob, the n-gram lookup over the
session's own tokens (capped at its match, `lookup_match`) proposes
instead, if `fallback` is "ngram"; its proposals are exact for the same reason.

The service learns a session's committed tokens from the messages it gets:
each propose carries the committed prefix as (start, tail), and so does the
close (`finish`, then `close`). So the whole answer goes into its tenant's
index, also the rounds that asked the draft for nothing (auto's K = 0). A
session that expires idle goes in with the tokens of its last message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specd.core.draft.ngram import lookup_match, lookup_matches, match_confidence
from specd.core.draft.protocol import propose_each
from specd.core.draft.suffix_index import NO_CANDIDATE, Candidate, SuffixIndex
from specd.core.draft.tenant_index import NO_TENANT, PER_TENANT, SHARING_MODES, TenantIndexes
from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.model.pool import SessionTable
from specd.core.rounds.steps import (
    ProposeRequest,
    TreeProposeRequest,
    check_num_tokens,
    check_prompt,
    check_tree_budget,
    sync_prefix,
)
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams

FALLBACKS = ("ngram", "none")


@runtime_checkable
class LearningDrafter(Protocol):
    """A drafter that learns from finished sessions: told a session's final committed tokens before its close."""

    def finish(self, session_id: str, committed_length: int, start: int, tail: Sequence[int]) -> None:
        """The session's committed prefix is its sequence cut at `start` followed by `tail`; close comes next."""
        ...


@dataclass(frozen=True)
class SuffixSettings:
    """Suffix drafting rules; defaults are the paper's and vLLM's (depth 24, factor 1.0, min prob 0.1)."""

    max_depth: int = 24  # context tokens a match may use
    max_spec_factor: float = 1.0  # propose at most factor * match length + offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop where the continuation's estimated probability drops below this
    index_bytes: int = 64 << 20  # all learned indexes together
    tenant_index_bytes: int = 16 << 20  # one tenant's learned index
    sharing: str = PER_TENANT  # "tenant": learned state per tenant; "shared": one index for all callers
    max_tenants: int = 1024  # learned indexes kept at most (least recently used dropped)
    global_anchor: int = 2  # tokens a global match needs at least (1 would scan every occurrence of a token)
    request_anchor: int = 1
    max_occurrences: int = 4096  # the most recent occurrences of the context's anchor that a query reads
    prompt_tail: int = 24  # prompt tokens stored before each output in the learned index (-1: the whole prompt)
    fallback: str = "ngram"  # "ngram": n-gram lookup when the indexes propose nothing; "none"

    def validate(self) -> None:
        if self.max_depth < max(self.global_anchor, self.request_anchor):
            raise InvalidArgument(f"suffix max_depth must be >= the anchors (got {self.max_depth})")
        if self.max_spec_factor <= 0 or self.max_spec_offset < 0:
            raise InvalidArgument("suffix max_spec_factor must be > 0 and max_spec_offset >= 0")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidArgument(f"suffix min_token_prob must be in [0, 1] (got {self.min_token_prob})")
        if self.index_bytes < 0 or self.tenant_index_bytes < 0:
            raise InvalidArgument(
                f"suffix index bytes must be >= 0 (got {self.index_bytes}, per tenant {self.tenant_index_bytes})"
            )
        if self.sharing not in SHARING_MODES:
            raise InvalidArgument(f"suffix sharing must be one of {', '.join(SHARING_MODES)} (got {self.sharing!r})")
        if self.max_tenants < 1:
            raise InvalidArgument(f"suffix max tenants must be >= 1 (got {self.max_tenants})")
        if self.prompt_tail < -1:
            raise InvalidArgument(f"suffix prompt_tail must be >= -1 (got {self.prompt_tail})")
        if self.fallback not in FALLBACKS:
            raise InvalidArgument(f"suffix fallback must be one of {', '.join(FALLBACKS)} (got {self.fallback!r})")

    def new_learned(self) -> TenantIndexes:
        """The learned indexes of finished sessions, by tenant."""
        return TenantIndexes(
            self.index_bytes,
            self.tenant_index_bytes,
            sharing=self.sharing,
            max_tenants=self.max_tenants,
            anchor=self.global_anchor,
            max_depth=self.max_depth,
            max_occurrences=self.max_occurrences,
        )


class SuffixSession:
    """One session's tokens (committed prefix + its last drafts), its own index over the committed ones, its tenant."""

    def __init__(self, prompt: Sequence[int], settings: SuffixSettings, tenant: str = NO_TENANT) -> None:
        self.tenant = tenant
        self.tokens = [int(t) for t in prompt]
        self.prompt_length = len(self.tokens)
        self.committed = len(self.tokens)  # committed prefix as of the last message
        self.index = SuffixIndex(
            anchor=settings.request_anchor, max_depth=settings.max_depth, max_occurrences=settings.max_occurrences
        )
        self.index.extend(self.tokens)

    def sync(self, committed_length: int, start: int, tail: Sequence[int]) -> None:
        """Apply a (start, tail) update; the index follows (cut back where the prefix changed)."""
        prefix = sync_prefix(self.tokens, committed_length, start, tail)
        keep = min(start, self.index.open_length())  # tokens before start are unchanged
        if self.index.open_length() > keep:
            self.index.truncate(keep)
        self.index.extend(prefix[keep:])
        self.tokens = prefix
        self.committed = len(prefix)

    def propose(self, drafts: Sequence[int]) -> None:
        """Drafts join the sequence, as a model drafter's do: the next `start` counts the accepted ones."""
        self.tokens.extend(drafts)

    def context(self, depth: int) -> list[int]:
        return self.tokens[max(0, self.committed - depth) : self.committed]

    def document(self, prompt_tail: int) -> list[int]:
        """What the learned index keeps of this session: its output after `prompt_tail` prompt tokens."""
        begin = 0 if prompt_tail < 0 else max(0, self.prompt_length - prompt_tail)
        if self.committed <= self.prompt_length:
            return []
        return self.tokens[begin : self.committed]


def best_candidate(
    session: SuffixSession, learned: TenantIndexes, settings: SuffixSettings, num_tokens: int
) -> tuple[Candidate, str]:
    """The better of the session's and its tenant's learned continuations, and where it came from."""
    ctx = session.context(settings.max_depth)
    rules = dict(factor=settings.max_spec_factor, offset=settings.max_spec_offset, min_prob=settings.min_token_prob)
    own = session.index.speculate(ctx, num_tokens, **rules)
    index = learned.index_for(session.tenant)
    shared = index.speculate(ctx, num_tokens, **rules) if index is not None else NO_CANDIDATE
    if shared.score > own.score:
        return shared, "global"
    return (own, "request") if len(own) else (NO_CANDIDATE, "none")


class SuffixDrafter:
    """Drafts from the session's own tokens and its tenant's index of finished sessions (see the module doc)."""

    kind = "suffix"

    def __init__(
        self,
        vocab_size: int,
        settings: SuffixSettings | None = None,
        *,
        max_sessions: int = 256,
        idle_timeout_s: float = 600.0,
    ) -> None:
        self.settings = settings or SuffixSettings()
        self.settings.validate()
        self.vocab_size = vocab_size
        self.learned = self.settings.new_learned()
        self.proposals_by_source: dict[str, int] = {"request": 0, "global": 0, "ngram": 0, "none": 0}
        self._sessions: SessionTable[SuffixSession] = SessionTable(
            max_sessions, idle_timeout_s=idle_timeout_s, on_evict=lambda _sid, s: self._learn(s)
        )

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = NO_TENANT,
        confidence: bool = True,  # its match scores cost nothing: always sent
    ) -> None:
        params.validate()
        tokens = check_prompt(token_ids, self.vocab_size)
        self._sessions.pop(session_id)  # a re-open rebuilds the session: its tokens are learnt once, at close
        self._sessions.put(session_id, SuffixSession(tokens, self.settings, tenant))

    def finish(self, session_id: str, committed_length: int, start: int, tail: Sequence[int]) -> None:
        """The session's final committed tokens (the close learns them); a session out of step keeps what it had."""
        if session_id not in self._sessions:
            return
        session = self._sessions.get(session_id)
        try:
            session.sync(committed_length, start, tail)
        except SessionOutOfSync:
            pass  # learn what it holds: the tokens as of its last message

    def close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        if session is not None:
            self._learn(session)

    def active_sessions(self) -> int:
        return len(self._sessions)

    def propose(self, request: ProposeRequest) -> Proposal:
        num_tokens = check_num_tokens(request.num_tokens)
        t0 = time.perf_counter()
        session = self._sessions.get(request.session_id)
        session.sync(request.committed_length, request.start, request.tail)
        candidate, source = best_candidate(session, self.learned, self.settings, num_tokens)
        found = list(candidate.token_ids)
        # per token: its continuation frequency given the ones before (probs are running products)
        confidence = tuple(p / q if q > 0 else 0.0 for p, q in zip(candidate.probs, [1.0, *candidate.probs]))
        if not found and self.settings.fallback == "ngram":
            found, agree = lookup_match(session.tokens, num_tokens, 3, 1, cap_at_match=True)
            confidence = match_confidence(agree, len(found))  # the lookup's own score: its agreeing context
            source = "ngram" if found else "none"
        self.proposals_by_source[source] += 1
        session.propose(found)
        return Proposal(found, compute_ms=(time.perf_counter() - t0) * 1e3, confidence=confidence)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """No model to share: each request on its own (a lookup takes well under a millisecond)."""
        return propose_each(self.propose, requests)

    def candidates(self, request: TreeProposeRequest) -> list[list[int]]:
        """A tree round's candidates: the better index's continuation first, the other's, then n-gram matches
        (if the fallback is on). The sequence becomes the committed prefix (a tree's nodes do not join it)."""
        check_tree_budget(request.budget, request.depth)
        session = self._sessions.get(request.session_id)
        session.sync(request.committed_length, request.start, request.tail)
        ctx = session.context(self.settings.max_depth)
        s = self.settings
        rules = dict(factor=s.max_spec_factor, offset=s.max_spec_offset, min_prob=s.min_token_prob)
        found = [session.index.speculate(ctx, request.depth, **rules)]
        index = self.learned.index_for(session.tenant)
        if index is not None:
            found.append(index.speculate(ctx, request.depth, **rules))
        out = [list(c.token_ids) for c in sorted(found, key=lambda c: -c.score) if len(c)]
        if s.fallback == "ngram":
            out += [m for m in lookup_matches(session.tokens, request.depth, 3, 1, request.budget) if m not in out]
        return out[: request.budget]

    def _learn(self, session: SuffixSession) -> None:
        self.learned.learn(session.tenant, session.document(self.settings.prompt_tail))
