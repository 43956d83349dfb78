"""The verifier: one target forward pass over K draft tokens, then the rejection sampler.

The target commits its own verdicts, so p never leaves this module and the
coordinator only hears (accepted, token, kind).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack

import numpy as np
import torch

from specd.core import phases as ph
from specd.core.errors import Internal, InvalidArgument
from specd.core.model.pool import BatchRun, PooledModel, PoolLimits, Ready
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.tree_forward import TreeLogits
from specd.core.phases import PhaseLog
from specd.core.rounds.steps import TreeVerifyOutcome, TreeVerifyRequest, VerifyOutcome, VerifyRequest, check_sync
from specd.core.sampling import compact_q, sampler
from specd.core.sampling.greedy import greedy_verdict
from specd.core.sampling.proposal import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_Q_WIDTH, Proposal
from specd.core.sampling.rejection import SparseProposal, TargetRows, rejection_sample
from specd.core.sampling.sampler import UNUSABLE_LOGITS, SamplingParams
from specd.core.sampling.tree_rejection import TreeVerdict, tree_greedy_verdict, tree_rejection_row


@dataclass
class _TargetSession:
    kv: KVSession  # kv.tokens is exactly the committed sequence between rounds
    params: SamplingParams


class Verifier(PooledModel[_TargetSession]):
    """Sessions of the target model (Verifier(runner, max_sessions=..., ...): see PoolLimits) and the
    verification step over them."""

    def __init__(
        self,
        runner: CausalLMRunner,
        *,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        max_q_width: int = DEFAULT_MAX_Q_WIDTH,
        **limits: Unpack[PoolLimits],
    ) -> None:
        if max_draft_tokens < 1 or max_q_width < 1:
            raise InvalidArgument("max_draft_tokens and max_q_width must be >= 1")
        super().__init__(runner, **limits)
        # K and q entries per row a verify may carry: the batch pads q to at most
        # max_batch x max_draft_tokens x max_q_width entries (proposal.Proposal.from_wire).
        self.max_draft_tokens = max_draft_tokens
        self.max_q_width = max_q_width

    def open(self, session_id: str, token_ids: Sequence[int], params: SamplingParams) -> None:
        params.validate()
        self._pool.open(session_id, token_ids, lambda kv: _TargetSession(kv, params))

    def verify(self, request: VerifyRequest) -> VerifyOutcome:
        """Verify `proposal` after the committed prefix and commit the verdict (a batch of one)."""
        return _one(self.verify_batch([request]))

    @torch.inference_mode()
    def verify_batch(
        self, requests: Sequence[VerifyRequest], *, beside: Callable[[], None] | None = None
    ) -> list[VerifyOutcome | Exception]:
        """Verify many sessions' proposals in one target forward pass; per-request outcome or error.

        beside: the caller's host work that needs nothing of this batch, run while its first pass runs
        (the runner's `beside`; the servicer's records of the batch before).

        A request that fails its own checks (unknown session, out of sync, bad
        drafts), whose drafts and verdict do not fit the KV budget
        (ResourceExhausted: the pool sheds the youngest such session), or whose
        row cannot be sampled (non-finite numbers, a proposal that breaks the
        sampler's rules), gets its exception and leaves the others alone; only
        a failing forward pass fails every request that reached it (out of
        memory: the batch is split and retried, and only a session that does
        not fit alone fails, with ResourceExhausted). Greedy and
        seeded outcomes do not depend on the batch: coins hash (seed, position).
        """
        outcomes: dict[int, VerifyOutcome] = {}
        run = self._pool.run_batch(
            requests,
            self._prepare,
            lambda part, batch: self._verify_ready(requests, part, batch.logs, outcomes, beside),
            what="verification",
            growth=lambda _req, _ready: 1,  # past the drafts: the verdict's recovered or bonus token
        )
        return _timed(run, outcomes)

    def _prepare(self, req: VerifyRequest) -> tuple[_TargetSession, int]:
        """Sync the session to the committed prefix and append the drafts (no forward yet)."""
        s = self._pool.get(req.session_id)
        start = len(s.kv.tokens) if req.start is None else req.start
        check_sync(len(s.kv.tokens), req.committed_length, start, req.tail)
        self.runner.splice(s.kv, start, req.tail)
        k = len(req.proposal)
        self._check_draft("a proposal", k, k, req.proposal.q_ids, req.committed_length, req.proposal.token_ids)
        self.runner.append(s.kv, req.proposal.token_ids)
        return s, 0

    def _check_draft(
        self, what: str, tokens: int, depth: int, q_ids: torch.Tensor | None, committed: int, token_ids: Sequence[int]
    ) -> None:
        """A proposal's or a tree's sizes against this service's limits, before anything is allocated."""
        if tokens > self.max_draft_tokens:
            raise InvalidArgument(
                f"{what} of {tokens} draft tokens; this service verifies at most {self.max_draft_tokens}"
            )
        if q_ids is not None and int(q_ids.shape[-1]) > self.max_q_width:
            raise InvalidArgument(f"q rows of {int(q_ids.shape[-1])} entries; the limit is {self.max_q_width}")
        if committed + depth + 1 > self.runner.max_context:
            raise InvalidArgument(
                f"{what} {depth} tokens deep after {committed} committed exceeds the context of "
                f"{self.runner.max_context}; send a shorter one"
            )
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
            raise InvalidArgument(f"a draft token id is outside the vocabulary [0, {self.vocab_size})")

    def _verify_ready(
        self,
        requests: Sequence[VerifyRequest],
        part: list[Ready[_TargetSession]],
        logs: list[PhaseLog],
        outcomes: dict[int, VerifyOutcome],
        caller_beside: Callable[[], None] | None = None,
    ) -> dict[int, Exception]:
        """Forward, rejection sampler and commit for one forward group of sessions that passed their checks.

        Returns {request index: error} for the rows that could not be sampled (the pool rolls them back).
        """
        ready = [(r.index, r.session) for r in part]
        ks = [len(requests[i].proposal) for i, _ in ready]
        batch_tokens = sum(len(s.kv.tokens) - s.kv.cached for _, s in ready)  # positions the forward runs
        for i, _ in ready:
            logs[i].batch_tokens = batch_tokens
        proposals: list[Proposal] = [requests[i].proposal for i, _ in ready]  # [B], q decoded beside the pass
        undecoded = [b for b, p in enumerate(proposals) if p.q_ids is None and p.compact_q is not None]
        verdicts: dict[int, tuple[int, int, bool] | Exception] = {}

        def decode() -> None:
            """The proposals' q rows from the wire's compact form (checked), while the pass runs: a row that
            fails its checks fails its own request (its drafts rolled back), as a row that cannot be sampled.
            Then the caller's own work (verify_batch's `beside`)."""
            for b in undecoded:
                p = proposals[b]
                assert p.compact_q is not None
                try:
                    q_ids, q_probs = compact_q.dense_from_compact(p.compact_q, self.vocab_size, p.token_ids)
                except InvalidArgument as exc:
                    verdicts[b] = exc
                    continue
                proposals[b] = dataclasses.replace(p, q_ids=q_ids, q_probs=q_probs)
            if caller_beside is not None:
                caller_beside()

        t0 = time.perf_counter_ns()
        logits = self.runner.logits_batch(  # B x [K_b+1, V]
            [s.kv for _, s in ready], [k + 1 for k in ks], beside=decode if undecoded or caller_beside else None
        )
        t1 = time.perf_counter_ns()
        if all(s.params.is_greedy for _, s in ready):  # p one-hot: the verdict comes off the logits (greedy.py)
            for b, (lg, p) in enumerate(zip(logits, proposals)):
                if b not in verdicts:
                    greedy = greedy_verdict(lg, p.token_ids)
                    verdicts[b] = greedy if greedy is not None else Internal(UNUSABLE_LOGITS)
        else:
            # A session whose logits are not finite at some position fails its own request only;
            # the others go on. p is computed where the sampler reads it (_target_rows).
            for b, lg in enumerate(logits):
                for error in sampler.unusable_logits(lg[None]).values():
                    verdicts.setdefault(b, error)
            lengths = [requests[i].committed_length for i, _ in ready]
            rows = [b for b in range(len(ready)) if b not in verdicts]
            verdicts.update(self._sample(rows, logits, ready, proposals, lengths, ks))
        t2 = time.perf_counter_ns()
        failed: dict[int, Exception] = {}
        for b, (i, s) in enumerate(ready):
            logs[i].add(ph.FORWARD, t0, t1)
            logs[i].add(ph.SAMPLING, t1, t2)
            verdict = verdicts[b]
            committed = requests[i].committed_length
            if isinstance(verdict, Exception):
                failed[i] = verdict  # its drafts go (rolled back by the pool); the session stays usable
                continue
            with logs[i].phase(ph.ROLLBACK):
                accepted, token, is_bonus = verdict
                deferred = requests[i].defer_bonus and is_bonus and ks[b] > 0
                self.runner.truncate(s.kv, committed + accepted)
                if not deferred:  # deferred: the bonus coin is never used; that position is the next draft's
                    self.runner.append(s.kv, [token])
            outcomes[i] = VerifyOutcome(
                accepted, -1 if deferred else token, is_bonus and not deferred, len(s.kv.tokens), 0.0, deferred=deferred
            )
        return failed

    @staticmethod
    def _sample(
        rows: list[int],
        logits: list[torch.Tensor],
        ready: list[tuple[int, _TargetSession]],
        proposals: Sequence[Proposal],
        committed: Sequence[int],
        ks: list[int],
    ) -> dict[int, tuple[int, int, bool] | Exception]:
        """The rejection sampler over the given sessions: {row: (accepted, token, is_bonus) or its error}.

        logits: B x [K_b+1, V], the forward's rows per session; proposals and committed [B]: each
        session's proposal (q decoded) and committed length. One batched call, its q padded to
        the widest W and K_max drafts (q = 0 on padding); if it refuses (a row breaks a sampler
        rule, or its p is not a distribution), each row again on its own, so that only the
        offending row fails. Verdicts do not depend on the batch (coins hash (seed, position)),
        so this changes nothing for the others.
        """
        if not rows:
            return {}
        k_max = max(ks[b] for b in rows)
        drafts = torch.zeros(len(rows), k_max, dtype=torch.int64)  # [B', K_max]
        for r, b in enumerate(rows):
            drafts[r, : ks[b]] = torch.tensor(proposals[b].token_ids, dtype=torch.int64)
        try:
            v = rejection_sample(
                _target_rows([logits[b] for b in rows], [ready[b][1].params for b in rows], k_max),
                drafts,
                _sparse_batch([proposals[b] for b in rows], k_max),
                seeds=torch.tensor([ready[b][1].params.seed for b in rows], dtype=torch.int64),
                start_positions=torch.tensor([committed[b] for b in rows], dtype=torch.int64),
                num_draft=torch.tensor([ks[b] for b in rows], dtype=torch.int64),
            )
        except Exception as exc:  # noqa: BLE001 - find the row(s) at fault, one by one
            if len(rows) == 1:
                return {rows[0]: exc}
            out: dict[int, tuple[int, int, bool] | Exception] = {}
            for b in rows:
                out.update(Verifier._sample([b], logits, ready, proposals, committed, ks))
            return out
        return {b: (int(v.num_accepted[r]), int(v.next_token[r]), bool(v.is_bonus[r])) for r, b in enumerate(rows)}

    # ---- tree rounds (docs/trees.md) ------------------------------------

    def verify_tree(self, request: TreeVerifyRequest) -> TreeVerifyOutcome:
        """verify_tree_batch of one request: its outcome, or its error raised."""
        return _one(self.verify_tree_batch([request]))

    @torch.inference_mode()
    def verify_tree_batch(self, requests: Sequence[TreeVerifyRequest]) -> list[TreeVerifyOutcome | Exception]:
        """Verify many sessions' draft trees (any sizes) in ONE tree forward; per-request outcome or error.

        Errors as in verify_batch: a request's own bad input or unsampleable row fails it alone.
        Each session commits its accepted path (KV kept from the tree pass) and the one more token.
        """
        outcomes: dict[int, TreeVerifyOutcome] = {}
        run = self._pool.run_batch(
            requests,
            self._prepare_tree,
            lambda part, batch: self._tree_ready(requests, part, batch.logs, outcomes),
            what="tree verification",
            growth=lambda req, _ready: req.tree.depth + 1,  # the deepest path and its one more token
        )
        return _timed(run, outcomes)

    def _prepare_tree(self, req: TreeVerifyRequest) -> tuple[_TargetSession, int]:
        """Sync the session to the committed prefix and check the tree against this service's limits."""
        s = self._pool.get(req.session_id)
        start = len(s.kv.tokens) if req.start is None else req.start
        check_sync(len(s.kv.tokens), req.committed_length, start, req.tail)
        tree = req.tree
        self._check_draft("a tree", len(tree), tree.depth, tree.q_ids, req.committed_length, tree.token_ids)
        tree.check_q(self.vocab_size)
        self.runner.splice(s.kv, start, req.tail)
        return s, 0

    def _tree_ready(
        self,
        requests: Sequence[TreeVerifyRequest],
        part: list[Ready[_TargetSession]],
        logs: list[PhaseLog],
        outcomes: dict[int, TreeVerifyOutcome],
    ) -> dict[int, Exception]:
        """One tree forward over the group, the verdicts (greedy rows off the logits), then each commit."""
        ready = [(r.index, r.session) for r in part]
        trees = [requests[i].tree for i, _ in ready]
        t0 = time.perf_counter_ns()
        results = self.runner.tree_logits_batch([s.kv for _, s in ready], trees)  # B x [N_b+1, V]
        t1 = time.perf_counter_ns()
        verdicts: dict[int, TreeVerdict | Exception] = {}
        sampled = []
        for b, (res, (_, s)) in enumerate(zip(results, ready)):
            if s.params.is_greedy:  # p one-hot: the deepest argmax path (tree_rejection.tree_greedy_verdict)
                greedy = tree_greedy_verdict(res.logits, res.tree)
                verdicts[b] = greedy if greedy is not None else Internal(UNUSABLE_LOGITS)
            else:
                sampled.append(b)
        verdicts.update(self._tree_sample(sampled, results, ready, requests))
        t2 = time.perf_counter_ns()
        failed: dict[int, Exception] = {}
        for b, (i, s) in enumerate(ready):
            logs[i].add(ph.FORWARD, t0, t1)
            logs[i].add(ph.SAMPLING, t1, t2)
            verdict = verdicts[b]
            if isinstance(verdict, Exception):
                failed[i] = verdict  # the session keeps its committed prefix (the pool rolls back)
                continue
            with logs[i].phase(ph.ROLLBACK):
                self.runner.keep_tree_path(s.kv, results[b], verdict.accepted)  # prefix + path, KV from the pass
                self.runner.append(s.kv, [verdict.next_token])
            path = verdict.accepted
            tokens = tuple(trees[b].token_ids[n] for n in path)
            outcomes[i] = TreeVerifyOutcome(path, tokens, verdict.next_token, verdict.is_bonus, len(s.kv.tokens))
        return failed

    @staticmethod
    def _tree_sample(
        rows: list[int],
        results: list[TreeLogits],
        ready: list[tuple[int, _TargetSession]],
        requests: Sequence[TreeVerifyRequest],
    ) -> dict[int, TreeVerdict | Exception]:
        """Recursive rejection sampling over the given rows, each on the host: {row: verdict or its error}.

        p is processed only for the rows the walk reads (the prefix and each accepted node: depth + 1
        of a tree's N + 1), as the chain's verify does (`_target_rows`); a row whose p cannot be
        sampled fails its request alone.
        """
        out: dict[int, TreeVerdict | Exception] = {}
        for b in rows:
            logits, params = results[b].logits, ready[b][1].params

            def read(i: int, logits: torch.Tensor = logits, params: SamplingParams = params) -> np.ndarray:
                p = sampler.processed_probs(logits[i][None, None, :], [params])[0, 0]  # [V]
                if sampler.unusable_rows(logits[i][None, None, :], p[None, None, :]):
                    raise Internal(sampler.UNUSABLE_PROBS)
                return p.to(torch.float64).numpy()

            try:
                start = requests[ready[b][0]].committed_length
                out[b] = tree_rejection_row(read, results[b].tree, params.seed, start)
            except Exception as exc:  # noqa: BLE001 - this row's error, in its slot
                out[b] = exc
        return out


def _target_rows(logits: list[torch.Tensor], params: list[SamplingParams], k_max: int) -> TargetRows:
    """The processed p of each session's rows (logits B x [K_b+1, V]), computed when the sampler reads them.

    The sampler reads position i of a session only while its drafts before i were accepted, and
    the position its token is drawn at: ~3 of 5 rows at K = 4 and acceptance 0.6, each a softmax
    over V. A read whose p is not a distribution raises (the caller finds the session at fault):
    with the logits checked finite beforehand, that is a NaN row (x / T overflowed), and a NaN in
    a softmax row (or anything made from it) is a NaN in every entry, so one entry tells.
    """
    V = int(logits[0].shape[-1])

    def read(b: np.ndarray, i: np.ndarray) -> torch.Tensor:
        pairs = list(zip(b.tolist(), i.tolist()))
        x = logits[pairs[0][0]][pairs[0][1]][None] if len(pairs) == 1 else torch.stack([logits[r][n] for r, n in pairs])
        p = sampler.processed_probs(x[:, None, :], [params[r] for r, _ in pairs], checked=True)[:, 0]  # [n, V]
        if bool(p[:, 0].isnan().any()):
            raise Internal(sampler.UNUSABLE_PROBS)
        return p

    return TargetRows((len(logits), k_max + 1, V), logits[0].device, read)


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


Out = TypeVar("Out", VerifyOutcome, TreeVerifyOutcome)


def _timed(run: BatchRun[Any], outcomes: dict[int, Out]) -> list[Out | Exception]:
    """Per request of a pool batch run: its error, or its outcome with the compute time its phases logged."""
    results: list[Out | Exception] = []
    for i, (error, log) in enumerate(zip(run.errors, run.logs)):
        if error is not None:
            results.append(error)
        else:
            ms = (log.phases[-1].end_ns - log.phases[0].start_ns) / 1e6
            results.append(dataclasses.replace(outcomes[i], compute_ms=ms, phases=log))
    return results


def _one(results: list[Out | Exception]) -> Out:
    """A batch of one's outcome, or its error raised."""
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]
