"""The n-gram drafter: prompt lookup, continuing the earliest occurrence of the sequence's last n-gram."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specd.core.draft.protocol import propose_each
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

AGREE_MAX = 32  # how far back a match's agreement is counted (for its confidence)


@dataclass
class _NgramSession:
    tokens: list[int]


class NgramDrafter:
    """Prompt lookup: continue the earliest occurrence of the sequence's last n-gram.

    No model and no q: proposals are one-hot, which the sampler treats exactly.
    Returns fewer than K tokens (possibly none) when the history offers fewer.
    """

    kind = "ngram"

    def __init__(
        self,
        vocab_size: int,
        *,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_sessions: int = 256,
        idle_timeout_s: float = 600.0,
        cap_at_match: bool = True,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.cap_at_match = cap_at_match  # see lookup_continuation
        self._sessions: SessionTable[_NgramSession] = SessionTable(max_sessions, idle_timeout_s=idle_timeout_s)

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = "",
        confidence: bool = True,  # its match statistics cost nothing: always sent
    ) -> None:
        params.validate()
        tokens = check_prompt(token_ids, self.vocab_size)
        self._sessions.put(session_id, _NgramSession(tokens))

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id)

    def active_sessions(self) -> int:
        return len(self._sessions)

    def propose(self, request: ProposeRequest) -> Proposal:
        num_tokens = check_num_tokens(request.num_tokens)
        t0 = time.perf_counter()
        s = self._sessions.get(request.session_id)
        s.tokens = sync_prefix(s.tokens, request.committed_length, request.start, request.tail)
        found, agree = lookup_match(
            s.tokens, num_tokens, self.max_ngram, self.min_ngram, cap_at_match=self.cap_at_match
        )
        # The drafts join the sequence, as a model drafter's do: the caller's next `start`
        # counts the accepted ones as already known here.
        s.tokens.extend(found)
        confidence = match_confidence(agree, len(found))
        return Proposal(found, compute_ms=(time.perf_counter() - t0) * 1e3, confidence=confidence)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """No model to share: each request on its own (a lookup takes microseconds)."""
        return propose_each(self.propose, requests)

    def candidates(self, request: TreeProposeRequest) -> list[list[int]]:
        """A tree round's candidates: the continuations of several matches, the chain's first.

        The sequence becomes the committed prefix (a tree's nodes do not join it)."""
        check_tree_budget(request.budget, request.depth)
        s = self._sessions.get(request.session_id)
        s.tokens = sync_prefix(s.tokens, request.committed_length, request.start, request.tail)
        return lookup_matches(
            s.tokens, request.depth, self.max_ngram, self.min_ngram, request.budget, cap_at_match=self.cap_at_match
        )


def lookup_continuation(
    tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int, *, cap_at_match: bool = False
) -> list[int]:
    """Up to k tokens that followed the earliest match of the longest suffix n-gram.

    Earliest, not latest: when an answer reproduces text from the prompt (code
    being edited), the first occurrence is usually the source being copied,
    while the latest is often a short repeat inside the answer itself (measured:
    docs/results/code-choices.md).

    cap_at_match: propose at most as many tokens as the match's agreeing
    context, L (the n-gram, extended backwards while the tokens before both
    occurrences agree). A long shared history predicts a long shared future,
    a one-token coincidence does not, and on a CPU every proposed token makes
    the target's verify dearer; min(L, 12) beats every fixed K on the edit
    prompts (docs/results/code-choices.md).
    """
    return lookup_match(tokens, k, max_ngram, min_ngram, cap_at_match=cap_at_match)[0]


def lookup_match(
    tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int, *, cap_at_match: bool = False
) -> tuple[list[int], int]:
    """lookup_continuation's tokens and the match's agreeing context L (counted up to max(k, AGREE_MAX))."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        for begin in range(n_tokens - n):
            if list(tokens[begin : begin + n]) == suffix:
                agree = n  # extend backwards: tokens[begin - j] == tokens[n_tokens - n - j]
                while (
                    agree < max(k, AGREE_MAX)
                    and begin - (agree - n) - 1 >= 0
                    and (tokens[begin - (agree - n) - 1] == tokens[n_tokens - agree - 1])
                ):
                    agree += 1
                take = min(k, agree) if cap_at_match else k
                return list(tokens[begin + n : begin + n + take]), agree
    return [], 0


def lookup_matches(
    tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int, limit: int, *, cap_at_match: bool = False
) -> list[list[int]]:
    """Up to `limit` distinct continuations of the sequence's last n-gram: lookup_match's first, then the
    other occurrences of the longest n-gram (earliest first), then those of shorter n-grams."""
    first, _ = lookup_match(tokens, k, max_ngram, min_ngram, cap_at_match=cap_at_match)
    out = [first] if first else []
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        for begin in range(n_tokens - n):
            if len(out) >= limit:
                return out
            if list(tokens[begin : begin + n]) == suffix:
                found = list(tokens[begin + n : begin + n + k])
                if found and found not in out:
                    out.append(found)
    return out


def match_confidence(agree: int, n: int) -> tuple[float, ...]:
    """Per token of an n-token continuation: L / (L + 1) for a match agreeing over L tokens.

    A score, not a probability (auto calibrates it from verdicts): a long shared
    history predicts a long shared future, a one-token coincidence does not."""
    return (agree / (agree + 1.0),) * n if agree > 0 else ()
