"""Drafters: propose K tokens after a session's committed prefix.

The protocol, the requests of a draft step and their sync, the reduced LM
head, and the n-gram drafter; the model drafter is specd.core.model_drafter.

A drafter keeps one sequence per session. The coordinator tells it the
committed prefix as (start, tail): cut the sequence at `start`, append `tail`.
Its own earlier drafts that were accepted are already in the sequence, so the
tail is normally just the target's recovered or bonus token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from specd.core.branching import Branches, BranchRequest, bonus_guess
from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.core.sessions import SessionTable


class Drafter(Protocol):
    """What the draft service and the in-process loop need from a drafter."""

    kind: str
    vocab_size: int

    def open(self, session_id: str, token_ids: Sequence[int], params: SamplingParams, wire_top_k: int = 0) -> None: ...

    def propose(
        self, session_id: str, committed_length: int, start: int, tail: Sequence[int], num_tokens: int
    ) -> Proposal: ...

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]: ...

    def close(self, session_id: str) -> None: ...

    def active_sessions(self) -> int: ...


@dataclass(frozen=True)
class ProposeRequest:
    """One session's part of a (batched) drafting step."""

    session_id: str
    committed_length: int
    start: int
    tail: Sequence[int]
    num_tokens: int


DraftWork = ProposeRequest | BranchRequest  # one step message of a draft service: a propose or a branch call
DraftResult = Proposal | Branches


@runtime_checkable
class BranchingDrafter(Protocol):
    """A drafter that drafts proposes and branch calls of many sessions in one batched pass per step."""

    def draft_batch(self, requests: Sequence[DraftWork]) -> list[DraftResult | Exception]: ...


def draft_work(drafter: Drafter, requests: Sequence[DraftWork]) -> list[DraftResult | Exception]:
    """Proposes and branch calls of different sessions, as one batch where the drafter can.

    A drafter without a distribution of its own (n-gram, suffix, hybrid)
    answers a branch call with the all-accepted verdict only: it drafts one
    token more after the whole prefix, the first being its guess of the bonus
    (specd.core.branching.bonus_guess). Its sequence then runs past the prefix;
    the next call's (start, tail) rolls it back as for any propose.
    """
    if isinstance(drafter, BranchingDrafter) and any(isinstance(r, BranchRequest) for r in requests):
        return drafter.draft_batch(requests)
    calls = [
        r
        if isinstance(r, ProposeRequest)
        else ProposeRequest(r.session_id, r.committed_length, r.start, r.tail, r.num_tokens + 1)
        for r in requests
    ]
    out: list[DraftResult | Exception] = []
    for r, result in zip(requests, drafter.propose_batch(calls)):
        if isinstance(r, BranchRequest) and not isinstance(result, Exception):
            out.append(bonus_guess(r.pending, result))
        else:
            out.append(result)
    return out


def propose_one(
    drafter: Drafter, session_id: str, committed_length: int, start: int, tail: Sequence[int], num_tokens: int
) -> Proposal:
    """propose() as a batch of one: the proposal, or the request's exception raised."""
    result = drafter.propose_batch([ProposeRequest(session_id, committed_length, start, tail, num_tokens)])[0]
    if isinstance(result, BaseException):
        raise result
    return result


def check_sync(held: int, committed_length: int, start: int, tail: Sequence[int]) -> None:
    """OutOfSync unless a (start, tail) update of a `held`-token sequence gives committed_length tokens."""
    if start > held:
        raise SessionOutOfSync(f"update starts at {start} but the session holds {held} tokens; re-open")
    if start + len(tail) != committed_length:
        raise SessionOutOfSync(
            f"update gives {start + len(tail)} committed tokens, message says {committed_length}; re-open"
        )


def sync_prefix(tokens: list[int], committed_length: int, start: int, tail: Sequence[int]) -> list[int]:
    """The committed prefix from a (start, tail) update; OutOfSync if it cannot be built.

    tokens: the service's current sequence, whose first `start` tokens the
    caller declares committed (its own accepted drafts among them).
    """
    check_sync(len(tokens), committed_length, start, tail)
    return tokens[:start] + [int(t) for t in tail]


class ReducedLMHead(nn.Module):
    """An LM head over a subset of the vocabulary: N rows instead of V.

    Logit row i belongs to target token ``token_map[i]``; every other token
    gets -inf (probability 0), so the full-width output still means "the
    draft's distribution over the target's token space" to any consumer
    (HF generate, CausalLMRunner), while the matmul costs N/V of the full head.
    A ModelDrafter given the same token_map reads only the N columns.
    """

    token_map: Tensor  # a registered buffer (moves with the module)

    def __init__(self, weight: Tensor, token_map: Tensor, vocab_size: int) -> None:
        super().__init__()
        assert weight.dim() == 2 and token_map.shape == weight.shape[:1], (
            f"weight must be [N, H] and token_map [N], got {tuple(weight.shape)} and {tuple(token_map.shape)}"
        )
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)  # [N, H]
        self.register_buffer("token_map", token_map.to(torch.int64).clone())  # [N] target token ids
        self.in_features = int(weight.shape[1])
        self.out_features = int(vocab_size)  # the full width (CausalLMRunner reads it)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., V]
        reduced = nn.functional.linear(hidden, self.weight)  # [..., N]
        out = reduced.new_full((*reduced.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.token_map, reduced)


def check_token_map(token_map: Tensor, vocab_size: int) -> Tensor:
    """token_map as int64 [N], or InvalidArgument: distinct target ids in [0, vocab_size)."""
    if token_map.dim() != 1 or token_map.numel() == 0 or token_map.is_floating_point():
        raise InvalidArgument(f"token_map must be a non-empty 1-D integer tensor, got {tuple(token_map.shape)}")
    token_map = token_map.to(torch.int64)
    if int(token_map.min()) < 0 or int(token_map.max()) >= vocab_size:
        raise InvalidArgument(f"token_map holds ids outside the vocabulary [0, {vocab_size})")
    if int(token_map.unique().numel()) != int(token_map.numel()):
        raise InvalidArgument("token_map holds a token id twice; each draft row must map to its own token")
    return token_map


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

    def open(self, session_id: str, token_ids: Sequence[int], params: SamplingParams, wire_top_k: int = 0) -> None:
        params.validate()
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidArgument("the prompt is empty; send at least one token")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise InvalidArgument(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        self._sessions.put(session_id, _NgramSession(tokens))

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id)

    def active_sessions(self) -> int:
        return len(self._sessions)

    def propose(
        self, session_id: str, committed_length: int, start: int, tail: Sequence[int], num_tokens: int
    ) -> Proposal:
        if num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be >= 1 (got {num_tokens})")
        t0 = time.perf_counter()
        s = self._sessions.get(session_id)
        s.tokens = sync_prefix(s.tokens, committed_length, start, tail)
        found = lookup_continuation(
            s.tokens, num_tokens, self.max_ngram, self.min_ngram, cap_at_match=self.cap_at_match
        )
        # The drafts join the sequence, as a model drafter's do: the caller's next `start`
        # counts the accepted ones as already known here.
        s.tokens.extend(found)
        return Proposal(found, compute_ms=(time.perf_counter() - t0) * 1e3)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """No model to share: each request on its own (a lookup takes microseconds)."""
        out: list[Proposal | Exception] = []
        for r in requests:
            try:
                out.append(self.propose(r.session_id, r.committed_length, r.start, r.tail, r.num_tokens))
            except Exception as exc:  # noqa: BLE001 - this request's error, reported in its slot
                out.append(exc)
        return out


def lookup_continuation(
    tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int, *, cap_at_match: bool = False
) -> list[int]:
    """Up to k tokens that followed the earliest match of the longest suffix n-gram.

    Earliest, not latest: when an answer reproduces text from the prompt (code
    being edited), the first occurrence is usually the source being copied,
    while the latest is often a short repeat inside the answer itself. On the
    shipped edit prompts' greedy answers (K = 4) the earliest match gives 3.12
    tokens per round against 2.95 for the latest (scripts/ngram_policy.py).

    cap_at_match: propose at most as many tokens as the match's agreeing
    context, L (the n-gram, extended backwards while the tokens before both
    occurrences agree). A long shared history predicts a long shared future,
    a one-token coincidence does not, and on a CPU every proposed token makes
    the target's verify dearer. Replayed on the edit prompts' greedy answers
    with a verify cost of 70 + 10 (K + 1) ms (scripts/ngram_policy.py),
    min(L, 12) gives 31.1 tokens/s against 27.0 for a fixed K = 4 and 27.9
    for the best fixed K (6).
    """
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        for begin in range(n_tokens - n):
            if list(tokens[begin : begin + n]) == suffix:
                take = k
                if cap_at_match:
                    agree = n  # extend backwards: tokens[begin - j] == tokens[n_tokens - n - j]
                    while (
                        agree < k
                        and begin - (agree - n) - 1 >= 0
                        and (tokens[begin - (agree - n) - 1] == tokens[n_tokens - agree - 1])
                    ):
                        agree += 1
                    take = min(k, agree)
                return list(tokens[begin + n : begin + n + take])
    return []
