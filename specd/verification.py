"""The verifier: one target forward pass over K draft tokens, then the rejection sampler.

The target commits its own verdicts, so p never leaves this module and the
coordinator only hears (accepted, token, kind).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd import sampling
from specd.drafting import sync_prefix
from specd.errors import InvalidArgument
from specd.proposal import Proposal
from specd.runner import CausalLMRunner, KVSession
from specd.sampling import SamplingParams, SparseProposal
from specd.sessions import KVBudget, SessionTable


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # draft tokens accepted (committed)
    token_id: int  # the recovered or bonus token (committed after them)
    is_bonus: bool
    committed_length: int  # after this verdict
    compute_ms: float


@dataclass
class _TargetSession:
    kv: KVSession  # kv.tokens is exactly the committed sequence between rounds
    params: SamplingParams


class Verifier:
    """Sessions of the target model and the verification step over them."""

    def __init__(
        self, runner: CausalLMRunner, *, max_sessions: int = 256, idle_timeout_s: float = 600.0, max_kv_bytes: int = 0
    ) -> None:
        self.runner = runner
        self._kv_budget = KVBudget(max_kv_bytes, lambda: runner.kv_bytes_per_token)
        self.vocab_size = runner.vocab_size
        self._sessions: SessionTable[_TargetSession] = SessionTable(
            max_sessions, idle_timeout_s=idle_timeout_s, on_evict=lambda _sid, s: runner.release(s.kv)
        )

    def open(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        params.validate()
        self._sessions.pop(session_id)  # a re-open replaces the session and its memory
        self._kv_budget.admit(sum(len(s.kv) for _, s in self._sessions), len(token_ids))
        self._sessions.put(session_id, _TargetSession(self.runner.new_session(token_ids), params))

    def close(self, session_id: str) -> None:
        s = self._sessions.pop(session_id)
        if s is not None:
            self.runner.release(s.kv)

    def active_sessions(self) -> int:
        return len(self._sessions)

    def kv_bytes(self) -> int:
        return sum(self.runner.kv_bytes(s.kv) for _, s in self._sessions)

    @torch.inference_mode()
    def verify(
        self,
        session_id: str,
        committed_length: int,
        proposal: Proposal,
        *,
        start: int | None = None,
        tail: Sequence[int] = (),
    ) -> VerifyOutcome:
        """Verify `proposal` after the committed prefix and commit the verdict.

        (start, tail) patch the committed prefix as in the drafter (normally
        start = committed_length, tail empty: the target commits its own verdicts).
        """
        t0 = time.perf_counter()
        s = self._sessions.get(session_id)
        start = len(s.kv.tokens) if start is None else start
        self.runner.set_tokens(s.kv, sync_prefix(s.kv.tokens, committed_length, start, tail))
        k = len(proposal)
        if committed_length + k + 1 > self.runner.max_context:
            raise InvalidArgument(
                f"{k} draft tokens after {committed_length} committed exceed the context of {self.runner.max_context}"
            )
        drafts = torch.tensor([proposal.token_ids], dtype=torch.int64).reshape(1, k)  # [1, K]
        if bool((drafts >= self.vocab_size).any()) or bool((drafts < 0).any()):
            raise InvalidArgument(f"a draft token id is outside the vocabulary [0, {self.vocab_size})")
        self.runner.append(s.kv, proposal.token_ids)
        logits = self.runner.logits(s.kv, k + 1)  # [K+1, V]
        p = sampling.processed_probs(logits[None], [s.params])  # [1, K+1, V] float32
        sparse = None
        if proposal.q_ids is not None and proposal.q_probs is not None and k > 0:
            sparse = SparseProposal(proposal.q_ids[None], proposal.q_probs[None])  # [1, K, W]
        verdict = sampling.rejection_sample(
            p,
            drafts,
            sparse,
            seeds=torch.tensor([s.params.seed], dtype=torch.int64),
            start_positions=torch.tensor([committed_length], dtype=torch.int64),
        )
        accepted = int(verdict.num_accepted[0])
        token = int(verdict.next_token[0])
        self.runner.truncate(s.kv, committed_length + accepted)
        self.runner.append(s.kv, [token])
        return VerifyOutcome(
            accepted=accepted,
            token_id=token,
            is_bonus=bool(verdict.is_bonus[0]),
            committed_length=len(s.kv.tokens),
            compute_ms=(time.perf_counter() - t0) * 1e3,
        )
