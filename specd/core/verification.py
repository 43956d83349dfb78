"""The verifier: one target forward pass over K draft tokens, then the rejection sampler.

The target commits its own verdicts, so p never leaves this module and the
coordinator only hears (accepted, token, kind).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specd.core import phases as ph
from specd.core import sampling
from specd.core.drafting import sync_prefix
from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.proposal import Proposal
from specd.core.runner import KVSession
from specd.core.sampling import SamplingParams, SparseProposal
from specd.core.sessions import PooledModel, Ready


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # draft tokens accepted (committed)
    token_id: int  # the recovered or bonus token (committed after them); -1 when deferred
    is_bonus: bool
    committed_length: int  # after this verdict
    compute_ms: float  # this session's wall time in the step (a batch's forward counts whole)
    phases: PhaseLog = field(default_factory=PhaseLog, compare=False, repr=False)  # where the time went
    deferred: bool = False  # all drafts accepted, bonus not drawn (VerifyRequest.defer_bonus)


@dataclass(frozen=True)
class VerifyRequest:
    """One session's part of a (batched) verification step."""

    session_id: str
    committed_length: int
    proposal: Proposal
    start: int | None = None  # (start, tail) patch the committed prefix, as in the drafter
    tail: Sequence[int] = ()
    # All drafts accepted: commit them only and leave the bonus position to the next
    # verify's first draft token (PEARL post-verify). Exact: that position then gets
    # an accept (or recover) coin instead of a bonus coin, never both.
    defer_bonus: bool = False


@dataclass
class _TargetSession:
    kv: KVSession  # kv.tokens is exactly the committed sequence between rounds
    params: SamplingParams


class Verifier(PooledModel[_TargetSession]):
    """Sessions of the target model (Verifier(runner, max_sessions=..., ...): see PoolLimits) and the
    verification step over them."""

    def open(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        params.validate()
        self._pool.open(session_id, token_ids, lambda kv: _TargetSession(kv, params))

    def verify(
        self,
        session_id: str,
        committed_length: int,
        proposal: Proposal,
        *,
        start: int | None = None,
        tail: Sequence[int] = (),
        defer_bonus: bool = False,
    ) -> VerifyOutcome:
        """Verify `proposal` after the committed prefix and commit the verdict (a batch of one)."""
        result = self.verify_batch([VerifyRequest(session_id, committed_length, proposal, start, tail, defer_bonus)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    @torch.inference_mode()
    def verify_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyOutcome | Exception]:
        """Verify many sessions' proposals in one target forward pass; per-request outcome or error.

        A request that fails its own checks (unknown session, out of sync, bad
        drafts) gets its exception and leaves the others alone; a failing
        forward pass fails every request that reached it. Greedy and seeded
        outcomes do not depend on the batch: coins hash (seed, position).
        """
        outcomes: dict[int, VerifyOutcome] = {}
        run = self._pool.run_batch(
            requests,
            self._prepare,
            lambda part, batch: self._verify_ready(requests, part, batch.logs, outcomes),
            what="verification",
        )
        results: list[VerifyOutcome | Exception] = []
        for i, (error, log) in enumerate(zip(run.errors, run.logs)):
            if error is not None:
                results.append(error)
            else:
                ms = (log.phases[-1].end_ns - log.phases[0].start_ns) / 1e6
                results.append(dataclasses.replace(outcomes[i], compute_ms=ms, phases=log))
        return results

    def _prepare(self, req: VerifyRequest) -> tuple[_TargetSession, int]:
        """Sync the session to the committed prefix and append the drafts (no forward yet)."""
        s = self._pool.get(req.session_id)
        start = len(s.kv.tokens) if req.start is None else req.start
        self.runner.set_tokens(s.kv, sync_prefix(s.kv.tokens, req.committed_length, start, req.tail))
        k = len(req.proposal)
        if req.committed_length + k + 1 > self.runner.max_context:
            raise InvalidArgument(
                f"{k} draft tokens after {req.committed_length} committed exceed the context of "
                f"{self.runner.max_context}"
            )
        if any(not 0 <= t < self.vocab_size for t in req.proposal.token_ids):
            raise InvalidArgument(f"a draft token id is outside the vocabulary [0, {self.vocab_size})")
        self.runner.append(s.kv, req.proposal.token_ids)
        return s, 0

    def _verify_ready(
        self,
        requests: Sequence[VerifyRequest],
        part: list[Ready[_TargetSession]],
        logs: list[PhaseLog],
        results: dict[int, VerifyOutcome],
    ) -> dict[int, Exception]:
        """Forward, rejection sampler and commit for one forward group of sessions that passed their checks."""
        ready = [(r.index, r.session) for r in part]
        ks = [len(requests[i].proposal) for i, _ in ready]
        k_max = max(ks)
        batch_tokens = sum(len(s.kv.tokens) - s.kv.cached for _, s in ready)  # positions the forward runs
        for i, _ in ready:
            logs[i].batch_tokens = batch_tokens
        t0 = time.time_ns()
        logits = self.runner.logits_batch([s.kv for _, s in ready], [k + 1 for k in ks])  # B x [K_b+1, V]
        t1 = time.time_ns()
        # Pad each row to K_max + 1 positions (repeating its last row: never read, the
        # sampler stops at num_draft) and each q to the widest W; q = 0 on padding.
        rows = [torch.cat([lg, lg[-1:].expand(k_max - k, -1)]) if k < k_max else lg for lg, k in zip(logits, ks)]
        p = sampling.processed_probs(torch.stack(rows), [s.params for _, s in ready])  # [B, K_max+1, V]
        drafts = torch.zeros(len(ready), k_max, dtype=torch.int64)  # [B, K_max]
        for b, (i, _) in enumerate(ready):
            drafts[b, : ks[b]] = torch.tensor(requests[i].proposal.token_ids, dtype=torch.int64)
        verdict = sampling.rejection_sample(
            p,
            drafts,
            _sparse_batch([requests[i].proposal for i, _ in ready], k_max),
            seeds=torch.tensor([s.params.seed for _, s in ready], dtype=torch.int64),
            start_positions=torch.tensor([requests[i].committed_length for i, _ in ready], dtype=torch.int64),
            num_draft=torch.tensor(ks, dtype=torch.int64),
        )
        t2 = time.time_ns()
        for b, (i, s) in enumerate(ready):
            logs[i].add(ph.FORWARD, t0, t1)
            logs[i].add(ph.SAMPLING, t1, t2)
            with logs[i].phase(ph.ROLLBACK):
                accepted = int(verdict.num_accepted[b])
                token = int(verdict.next_token[b])
                is_bonus = bool(verdict.is_bonus[b])
                deferred = requests[i].defer_bonus and is_bonus and ks[b] > 0
                committed = requests[i].committed_length
                self.runner.truncate(s.kv, committed + accepted)
                if not deferred:  # deferred: the bonus coin is never used; that position is the next draft's
                    self.runner.append(s.kv, [token])
            results[i] = VerifyOutcome(
                accepted, -1 if deferred else token, is_bonus and not deferred, len(s.kv.tokens), 0.0, deferred=deferred
            )
        return {}


def _sparse_batch(proposals: Sequence[Proposal], k_max: int) -> SparseProposal | None:
    """The batch's q as [B, K_max, W]: None if every proposal is one-hot; one-hot rows spelled out otherwise."""
    if k_max == 0 or all(p.q_ids is None or p.q_probs is None for p in proposals):
        return None
    width = max(int(p.q_ids.shape[1]) for p in proposals if p.q_ids is not None)
    ids = torch.zeros(len(proposals), k_max, width, dtype=torch.int64)
    probs = torch.zeros(len(proposals), k_max, width, dtype=torch.float32)
    for b, p in enumerate(proposals):
        k = len(p)
        if k == 0:
            continue
        if p.q_ids is None or p.q_probs is None:  # one-hot at each draft token: q(token) = 1
            ids[b, :k, 0] = torch.tensor(p.token_ids, dtype=torch.int64)
            probs[b, :k, 0] = 1.0
        else:
            ids[b, :k, : p.q_ids.shape[1]] = p.q_ids
            probs[b, :k, : p.q_probs.shape[1]] = p.q_probs
    return SparseProposal(ids, probs)
