"""The model drafter: a causal LM drafting for many sessions, one batched forward per step.

Each session keeps one KV cache of the draft model, rolled back by position
(specd.core.model.runner). A propose drafts K tokens after the committed prefix; a
speculation cache's branch call (specd.core.draft.branching) drafts K tokens after
each of the likeliest verdicts of the proposal being verified, every branch a
fork of the session's cache, all of them rows of the same forward passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Unpack

import numpy as np
import torch
from torch import Tensor

from specd.core import phases as ph
from specd.core.draft.branching import BranchChoice, Ranking, calibrated_greedy, select_branches, top_ranking
from specd.core.draft.growing_draft import DueConfidence, GrowingDraft, encode_pending
from specd.core.draft.protocol import propose_one
from specd.core.draft.ranking_rows import RankingRows
from specd.core.errors import Internal, InvalidArgument, SessionNotFound
from specd.core.model.pool import BatchRun, PooledModel, PoolLimits, Ready
from specd.core.model.reduced_head import check_token_map
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.phases import PhaseLog
from specd.core.rounds.adaptive import PositionAcceptance
from specd.core.rounds.steps import (
    MAX_BRANCH_BUDGET,
    Branch,
    Branches,
    BranchRequest,
    DraftResult,
    DraftWork,
    ProposeRequest,
    check_num_tokens,
    check_sync,
)
from specd.core.sampling import sampler, sparse_q
from specd.core.sampling.bonus_guess import coupled_guess, coupled_guess_dense
from specd.core.sampling.greedy import greedy_tokens
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import UNUSABLE_LOGITS, SamplingParams
from specd.core.sampling.sparse_q import QSettings

log = logging.getLogger(__name__)

_IDLE_ROWS = 32  # sequences per idle pass: what a request arriving meanwhile may wait behind
# Idle passes only while at most this many sessions branch: with more, the model thread is rarely
# idle for long, and a pass started in a gap holds the next sessions' calls up by a whole draft step
# (emulated h100-tp2-70b, 16 streams of spec-cache K = 2: round wall p50 56.6 -> 80.5 ms).
_IDLE_SESSIONS = 2
_BRANCHING_PROPOSES = 2  # proposes after a branch call during which idle() keeps the bonus row ready


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _ModelDraftSession:
    kv: KVSession
    params: SamplingParams
    q: QSettings  # how this session's sparse q is truncated and rounded
    # A branch call's forks (each a sequence of its own), kept until the session's next call:
    branches: list[_ModelDraftSession] = field(default_factory=list)
    fork_at: int = 0  # tokens kv and every branch share (the committed prefix of the branch call)
    # The rows it drafted from, for its next branch call's ranking (specd.core.draft.ranking_rows);
    # with `branching` > 0 (a branch call lately) the draft adds the bonus row when idle.
    rows: RankingRows = field(default_factory=RankingRows)
    branching: int = 0  # proposes left during which idle() keeps the bonus row ready (a branch call sets it)
    confidence: bool = True  # its proposals carry each token's confidence (False: the caller reads none)


_Key = tuple[int, ...]  # a drafting row: (request index,) for a propose, (request index, branch) for a branch


@dataclass
class _BranchPass:
    """One branch call in a batched draft: step 0 reads the pending positions, steps 1.. draft every branch."""

    request: BranchRequest
    steps: int  # draft tokens per branch
    ranked: bool = False  # chosen from kept rows before the first pass (no step reading the pending positions)
    choices: list[BranchChoice] = field(default_factory=list)
    forks: list[_ModelDraftSession] = field(default_factory=list)  # parallel to choices


class ModelDrafter(PooledModel[_ModelDraftSession]):
    """Drafts with a causal LM, one KV cache per session, rolled back by position.

    token_map [N] (optional): the draft proposes only among these target token
    ids (a reduced-vocabulary head, see ReducedLMHead); logit column
    token_map[i] is its row i. q is the draft's distribution over those N
    tokens and 0 elsewhere; sampled tokens and wire ids are target ids, and
    the draft still samples from exactly the sparse q it sends.
    """

    kind = "model"

    def __init__(
        self,
        runner: CausalLMRunner,
        *,
        q: QSettings | None = None,
        wire_top_k: int = 0,
        token_map: Tensor | None = None,
        encode_q: bool = False,
        **limits: Unpack[PoolLimits],
    ) -> None:
        super().__init__(runner, **limits)
        # q rows also in the wire's compact form (Proposal.compact_q), each step's encoded while the next
        # step's pass runs (the runner's `beside`): what a draft service sends, ready when the draft ends
        self.encode_q = encode_q
        self.token_map: Tensor | None = None  # [N] int64 on the model's device
        self._host_map: Tensor | None = None  # [N] int64 on the host: q's slots -> target ids
        if token_map is not None:
            self._host_map = check_token_map(token_map, runner.vocab_size).cpu()
            self.token_map = self._host_map.to(runner.device)
        if wire_top_k < 0:
            raise InvalidArgument(f"wire_top_k must be >= 0 (0: q by mass), got {wire_top_k}")
        self.q = (q or QSettings()).validate()
        self.default_q = QSettings.top_k(wire_top_k, self.q.bits) if wire_top_k else self.q
        self._ranked: dict[int, Tensor] = {}  # id(session) -> its branch call's ranking rows, read from kept rows

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = "",
        confidence: bool = True,
    ) -> None:
        params.validate()
        if wire_top_k < 0:
            raise InvalidArgument("wire_top_k must be >= 0 (0 means the server default)")
        q = QSettings.top_k(wire_top_k, self.q.bits) if wire_top_k else self.default_q
        self._pool.open(session_id, token_ids, lambda kv: _ModelDraftSession(kv, params, q, confidence=confidence))

    def propose(self, request: ProposeRequest) -> Proposal:
        return propose_one(self, request)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        out: list[Proposal | Exception] = []
        for result in self.draft_batch(requests):
            assert not isinstance(result, Branches)
            out.append(result)
        return out

    def close(self, session_id: str) -> None:
        try:
            self._drop_branches(self._pool.get(session_id))
        except SessionNotFound:
            return
        self._pool.close(session_id)

    def kv_bytes(self) -> int:
        return self._pool.kv_bytes() + sum(self.runner.kv_bytes(b.kv) for s in self._pool.values() for b in s.branches)

    @torch.inference_mode()
    def idle(self) -> bool:
        """While nothing is queued: the bonus row of sequences a branch call may rank next; True if it ran a pass.

        A session that made a branch call lately, and each of its branches, has the rows of the
        tokens it drafted (specd.core.draft.ranking_rows); one forward over their last tokens adds
        the row after them, so the next branch call ranks without reading the pending positions
        again. At most _IDLE_ROWS sequences a pass; the caller asks again while nothing else waits.
        None while more than _IDLE_SESSIONS sessions branch: their calls keep the model thread busy.
        """
        branching = [s for s in self._pool.values() if s.branching > 0]
        if len(branching) > _IDLE_SESSIONS:
            return False
        forks = {id(b) for s in branching for b in s.branches}  # their rows may be views (ranking_rows)
        due = [q for s in branching for q in (s, *s.branches) if q.rows.rows and q.rows.end == len(q.kv.tokens)]
        if not due:
            return False
        due = due[:_IDLE_ROWS]
        try:
            out = self.runner.logits_batch([q.kv for q in due], [1] * len(due))
        except Exception:  # noqa: BLE001 - only a head start: the branch call reads the rows itself then
            log.debug("the idle pass for branch rows failed", exc_info=True)
            for q in due:
                q.rows = RankingRows()
            return True
        for q, logits in zip(due, out):
            q.rows.keep(len(q.kv.tokens), logits[-1], view=id(q) in forks)
        return True

    @torch.inference_mode()
    def draft_batch(self, requests: Sequence[DraftWork]) -> list[DraftResult | Exception]:
        """Draft for many sessions at once: step i runs one forward over every row still drafting.

        A propose is one row per step. A branch call is one row at step 0 (the
        pending positions and the one after them, read in one go, choose the
        branches) and one row per branch at every later step. Per-request
        checks, and a row that cannot be sampled (non-finite numbers), fail
        only that request; so does a step that does not fit the KV budget
        (ResourceExhausted, the youngest session first) and one that runs out
        of memory even alone (the pool splits a group that runs out of memory
        and drafts each half again); any other failing forward fails the
        sessions in it. A failed session is rolled back to its committed
        prefix and forgets its branches. The tokens do not depend on the batch: greedy is an argmax,
        sampling uses the (seed, position) coins, so a branch drafts what a
        propose for its prefix would.
        """
        drafted: dict[_Key, GrowingDraft] = {}
        branched: dict[int, _BranchPass] = {}
        self._ranked.clear()
        run = self._pool.run_batch(
            requests,
            self._prepare_any,
            lambda part, batch: self._draft_group(part, batch, requests, drafted, branched),
            what="drafting",
            growth=self._growth,
        )
        out: list[DraftResult | Exception] = []
        for i, error in enumerate(run.errors):
            if error is not None:
                if isinstance(requests[i], BranchRequest):
                    self._forget_branches(requests[i].session_id)
                out.append(error)
            elif i in branched:
                out.append(self._branches(i, branched[i], drafted, run.logs[i]))
            else:
                out.append(drafted[(i,)].proposal(run.logs[i]))
        return out

    @staticmethod
    def _growth(req: DraftWork, ready: Ready[_ModelDraftSession]) -> int:
        """Tokens a step may add to the session's sequence: a propose's drafts plus the one the verdict
        adds at the next sync (all accepted: the bonus); a branch call's sequence does not grow (its
        branches are separate sequences, admitted by _branch_room)."""
        return 0 if isinstance(req, BranchRequest) else ready.extra + 1

    def _held_tokens(self, session: _ModelDraftSession) -> int:
        return len(session.kv) + sum(len(b.kv) for b in session.branches)

    def _prepare_any(self, req: DraftWork) -> tuple[_ModelDraftSession, int]:
        return self._prepare_branches(req) if isinstance(req, BranchRequest) else self._prepare(req)

    def _prepare(self, req: ProposeRequest) -> tuple[_ModelDraftSession, int]:
        """A request's checks and sync: its session, brought to the committed prefix, and the tokens to draft."""
        check_num_tokens(req.num_tokens)
        s = self._pool.get(req.session_id)
        self._sync(s, req.committed_length, req.start, req.tail)
        s.branching = max(0, s.branching - 1)
        n = min(req.num_tokens, self.runner.max_context - req.committed_length)
        if n < 1:
            raise InvalidArgument("the session fills the draft model's context; nothing left to draft")
        return s, n

    def _prepare_branches(self, req: BranchRequest) -> tuple[_ModelDraftSession, int]:
        """A branch call's checks and sync; the steps it runs: 1 (read the pending positions) + tokens per branch.

        No room left in the context for a branch: 0 steps, no branches (not an error)."""
        check_num_tokens(req.num_tokens)
        if not 1 <= req.budget <= MAX_BRANCH_BUDGET:
            raise InvalidArgument(f"budget must be in 1..{MAX_BRANCH_BUDGET} branches (got {req.budget})")
        if not 1 <= req.pending < req.committed_length:
            raise InvalidArgument(
                f"pending must be in 1..{req.committed_length - 1} (the prefix's tokens after the first), "
                f"got {req.pending}"
            )
        if req.acceptance and (len(req.acceptance) != req.pending or not all(0.0 <= a <= 1.0 for a in req.acceptance)):
            raise InvalidArgument(f"acceptance needs {req.pending} rates in [0, 1], one per pending token, or none")
        s = self._pool.get(req.session_id)
        self._sync(s, req.committed_length, req.start, req.tail)
        s.branching = _BRANCHING_PROPOSES
        n = min(req.num_tokens, self.runner.max_context - req.committed_length - 1)  # the bonus branch is longest
        if n < 1:
            return s, 0
        # The pending positions' rows and the bonus row, if the sequence kept them: no reading step.
        rows = s.rows.span(req.committed_length - req.pending, req.pending + 1)
        if rows is None:
            return s, n + 1
        self._ranked[id(s)] = rows
        return s, n

    def _sync(self, s: _ModelDraftSession, committed_length: int, start: int, tail: Sequence[int]) -> None:
        """Bring the session to its prefix, adopting the branch that holds the most of it (no recompute).

        Every branch shares the first `fork_at` tokens with the sequence, so a
        `start` within them means the same tokens in all of them; the sequence
        or branch agreeing longest with `tail` becomes the sequence, and every
        other branch is dropped (branches live until the next call).
        """
        check_sync(len(s.kv.tokens), committed_length, start, tail)
        if s.branches:
            kept = s.kv
            if start <= s.fork_at:
                kept = max(
                    [s.kv, *(b.kv for b in s.branches)],
                    key=lambda kv: _common(kv.tokens[start : start + len(tail)], tail),
                )
            if kept is not s.kv:
                self.runner.release(s.kv)
                s.kv = kept
                s.rows = next(b.rows for b in s.branches if b.kv is kept).owned()  # the rows it drafted from
            self._drop_branches(s, keep=kept)
        s.rows.rewound(start + _common(s.kv.tokens[start:], tail))  # rows after a changed token are stale
        self.runner.splice(s.kv, start, tail)

    def _drop_branches(self, s: _ModelDraftSession, keep: KVSession | None = None) -> None:
        for b in s.branches:
            if b.kv is not keep:
                self.runner.release(b.kv)
        s.branches = []

    def _forget_branches(self, session_id: str) -> None:
        try:
            self._drop_branches(self._pool.get(session_id))
        except SessionNotFound:
            pass

    def _branch_room(self, wanted: int, tokens: int) -> int:
        """How many branches of `tokens` tokens each fit the pool's KV budget next to what it holds and
        what the step under way was granted (other sessions' drafts, branches made before these)."""
        limit = self._pool.budget.max_tokens()
        if not limit or wanted <= 0:
            return max(0, wanted)
        free_tokens = limit - self._pool.held_tokens() - self._pool.reserved_tokens()
        return max(0, min(wanted, free_tokens // max(1, tokens)))

    def _draft_group(
        self,
        part: list[Ready[_ModelDraftSession]],
        run: BatchRun[_ModelDraftSession],
        requests: Sequence[DraftWork],
        drafted: dict[_Key, GrowingDraft],
        branched: dict[int, _BranchPass],
    ) -> dict[int, Exception]:
        """One forward group: at each step, one forward over every row that still drafts.

        Returns {request index: error} for the requests that could not be sampled: they drop out alone.
        """
        failed: dict[int, Exception] = {}
        for r in part:
            req = requests[r.index]
            if not isinstance(req, BranchRequest):
                drafted[(r.index,)] = GrowingDraft(guess_first=req.guess_bonus)
                continue
            kept = self._ranked.pop(id(r.session), None)
            if kept is None:  # step 0 reads the pending positions, then the branches draft
                branched[r.index] = _BranchPass(req, max(0, r.extra - 1))
                continue
            ranked = branched[r.index] = _BranchPass(req, r.extra, ranked=True)  # ranked from kept rows now
            try:
                self._choose_branches(r.index, r.session, kept, ranked, drafted)
            except Exception as exc:  # noqa: BLE001 - this request's rows could not be ranked: it alone fails
                failed[r.index] = exc
        due = DueConfidence()  # greedy rows' confidences, worked out beside the next step's pass
        for step in range(max((r.extra for r in part), default=0)):
            rows: list[tuple[_Key, _ModelDraftSession]] = []
            parents: list[tuple[int, _ModelDraftSession]] = []
            for r in part:
                if r.extra <= step or r.index in failed:
                    continue
                bp = branched.get(r.index)
                if bp is None:
                    rows.append(((r.index,), r.session))
                elif step == 0 and not bp.ranked:
                    parents.append((r.index, r.session))
                else:
                    rows.extend(((r.index, b), fork) for b, fork in enumerate(bp.forks))
            if rows or parents:
                failed.update(self._draft_step(rows, parents, drafted, branched, due, run.logs))
        due.settle()  # the last step's: no pass left to run them beside
        if self.encode_q:  # the last step's rows: no pass left to encode them beside
            encode_pending(drafted.values())
        return failed

    def _draft_step(
        self,
        active: list[tuple[_Key, _ModelDraftSession]],
        parents: list[tuple[int, _ModelDraftSession]],
        drafted: dict[_Key, GrowingDraft],
        branched: dict[int, _BranchPass],
        due: DueConfidence,
        logs: list[PhaseLog],
    ) -> dict[int, Exception]:
        """One token for each active row and the branches of each parent: a batched forward, then q and sampling.

        Returns {request index: error} for the requests with a row that could not
        be sampled (non-finite numbers); the others are unaffected.
        """
        t0 = time.perf_counter_ns()
        num_last = [1] * len(active) + [branched[i].request.pending + 1 for i, _ in parents]

        def beside() -> None:  # the step before's greedy confidences and q rows, while this step's pass runs
            due.settle()
            if self.encode_q:
                encode_pending(drafted.values())

        out = self.runner.logits_batch([s.kv for _, s in active] + [s.kv for _, s in parents], num_last, beside=beside)
        sampled = _stacked(out[: len(active)]) if active else None  # [A, V]: each row this step's token is drawn from
        for a, (key, s) in enumerate(active):
            if s.branching > 0 and sampled is not None:  # a sequence a branch call may rank next: keep it
                s.rows.keep(len(s.kv.tokens), sampled[a], view=len(key) > 1)  # a branch's: a view (ranking_rows)
        for (i, s), logits in zip(parents, out[len(active) :]):  # [pending + 1, V]
            s.rows.keep_all(len(s.kv.tokens) - branched[i].request.pending, logits)
        t1 = time.perf_counter_ns()
        failed = self._sample_step(active, sampled, drafted, due) if sampled is not None else {}
        for (i, s), logits in zip(parents, out[len(active) :]):  # logits [pending + 1, V]
            try:
                self._choose_branches(i, s, logits, branched[i], drafted)
            except Exception as exc:  # noqa: BLE001 - this request's rows could not be ranked: it alone fails
                failed[i] = exc
        t2 = time.perf_counter_ns()
        for i in dict.fromkeys([key[0] for key, _ in active] + [i for i, _ in parents]):
            logs[i].add(ph.FORWARD, t0, t1)
            logs[i].add(ph.SAMPLING, t1, t2)
        return failed

    def _sample_step(
        self,
        active: list[tuple[_Key, _ModelDraftSession]],
        logits: Tensor,
        drafted: dict[_Key, GrowingDraft],
        due: DueConfidence,
    ) -> dict[int, Exception]:
        """Sample one token per active row from its logits [A, V] and append it; {request: error}.
        A greedy row's confidence is left due (DueConfidence)."""
        if self.token_map is not None:
            logits = logits[:, self.token_map]  # [A, N]: the reduced head's own rows
        failed: dict[int, Exception] = {}
        tokens: dict[int, int] = {}  # row -> token
        greedy = [a for a, (_, s) in enumerate(active) if s.params.is_greedy]
        if greedy:
            self._greedy_rows(greedy, _rows(logits, greedy), active, drafted, failed, tokens, due)
        rest = [a for a in range(len(active)) if not active[a][1].params.is_greedy]
        sampled: dict[QSettings, list[int]] = {}  # rows of `rest` by q settings: each group shares one build
        probs = logits  # [R, V or N]: the processed p of the rest's rows, in their order
        total = np.zeros(0)  # [R] float64: each row's mass (q's total)
        if rest:
            rest_logits = _rows(logits, rest)  # [R, V or N]
            params = [active[a][1].params for a in rest]  # validated when their sessions opened
            probs = sampler.processed_probs(rest_logits[:, None], params, checked=True)[:, 0]
            total, unusable = sampler.sampled_mass(rest_logits, probs)  # one pass: the check and q's total
            for r, a in enumerate(rest):
                if r in unusable:
                    failed[active[a][0][0]] = unusable[r]
                else:
                    sampled.setdefault(active[a][1].q, []).append(r)
        tq = time.perf_counter_ns()
        for settings, group in sampled.items():
            try:
                self._sample_rows(group, rest, settings, probs, total, active, drafted, tokens)
            except Exception:  # noqa: BLE001 - find the row(s) at fault: each alone, the others go on
                for r in group:
                    try:
                        self._sample_rows([r], rest, settings, probs, total, active, drafted, tokens)
                    except Exception as exc:  # noqa: BLE001 - this row's sampling failed: its request alone
                        failed[active[rest[r]][0][0]] = exc
        q_ms = (time.perf_counter_ns() - tq) / 1e6
        for a, (key, s) in enumerate(active):
            if a not in tokens:
                continue
            self.runner.append(s.kv, [tokens[a]])
            drafted[key].tokens.append(tokens[a])
            if not s.params.is_greedy:
                drafted[key].q_ms += q_ms  # a batch's shared build counts whole, like its forward
        return failed

    def _greedy_rows(
        self,
        greedy: list[int],
        logits: Tensor,
        active: list[tuple[_Key, _ModelDraftSession]],
        drafted: dict[_Key, GrowingDraft],
        failed: dict[int, Exception],
        tokens: dict[int, int],
        due: DueConfidence,
    ) -> None:
        """The argmax of each greedy row (logits [G, V or N]), off the logits (specd.core.sampling.greedy).

        q is one-hot: nothing to send. Its confidence is the softmax's top probability (what the
        argmax would be sampled with at T = 1), one fused pass over the row, left due: worked out
        beside the next step's pass (DueConfidence).
        """
        best, bad = greedy_tokens(logits)  # [G] each
        drafts: list[GrowingDraft | None] = []  # where each row's confidence goes (None: nowhere)
        for a, token, unusable in zip(greedy, best.tolist(), bad.tolist()):
            if unusable:
                failed[active[a][0][0]] = Internal(UNUSABLE_LOGITS)
            else:
                tokens[a] = self._target_id(token)
            wanted = not unusable and active[a][1].confidence
            drafts.append(drafted[active[a][0]] if wanted else None)
        if any(d is not None for d in drafts):
            due.add(logits, best, drafts)

    def _choose_branches(
        self, i: int, s: _ModelDraftSession, logits: Tensor, bp: _BranchPass, drafted: dict[_Key, GrowingDraft]
    ) -> None:
        """Rank the verdicts of the pending tokens by the rule (specd.core.draft.branching) and fork the chosen ones.

        logits: [K+1, V] rows predicting each pending token and the one after them.
        """
        req, k = bp.request, bp.request.pending
        if self.token_map is not None:
            logits = logits[:, self.token_map]  # [K+1, N]
        base = len(s.kv.tokens) - k  # the committed prefix
        pending = s.kv.tokens[base:]
        columns = pending if self.token_map is None else [self._column(t) for t in pending]
        acceptance = req.acceptance or PositionAcceptance().rates(k)
        width = req.budget + 1  # a row's own token is no alternative to itself
        # Ranked by the request's processed distribution with the measured acceptance; a greedy
        # request's is a one-hot, so it ranks by the calibrated softmax (specd.core.draft.branching).
        guess: int | None = None  # sampled: the bonus guessed at the target's coin (greedy: the argmax is)
        if s.params.is_greedy:
            calibrated = calibrated_greedy(logits, columns, acceptance, width)
            if calibrated is None:
                raise Internal(UNUSABLE_LOGITS)
            ranking, acceptance = calibrated
        else:
            processed = sampler.processed_probs(logits[None], [s.params])  # [1, K+1, V or N]
            unusable = sampler.unusable_rows(logits[None], processed, sampled=True)
            if unusable:
                raise unusable[0]
            ranking = top_ranking(processed[0], columns, width)
            bonus = processed[0, k : k + 1]  # [1, V or N] the bonus position's q, guessed at the target's coin
            seed, at = torch.tensor([s.params.seed]), torch.tensor([len(s.kv.tokens)])
            if self.token_map is None:
                guess = int(coupled_guess_dense(bonus, seed, at)[0])
            else:  # the reduced head's columns, in target-id order
                guess = int(coupled_guess(self.token_map[None], bonus, seed, at)[0])
        if self.token_map is not None:  # the reduced head's columns -> target ids
            ranking = Ranking(self.token_map[ranking.ids], ranking.probs, ranking.own)
        self._drop_branches(s)  # a retried group's earlier try may have forked already
        budget = self._branch_room(req.budget, len(s.kv.tokens) + 1 + bp.steps)
        bp.choices = select_branches(ranking, pending, acceptance, budget, guess)
        for b, choice in enumerate(bp.choices):
            kv = self.runner.fork(s.kv)  # shares the cache: the crop below only narrows the fork's view
            self.runner.truncate(kv, base + choice.accepted)
            self.runner.append(kv, [choice.token_id])
            self._pool.reserve(kv, len(kv) + bp.steps)  # the drafts it will grow by, for the next _branch_room
            bp.forks.append(
                _ModelDraftSession(kv, s.params, s.q, branching=_BRANCHING_PROPOSES, confidence=s.confidence)
            )
            drafted[(i, b)] = GrowingDraft()
        s.branches, s.fork_at = list(bp.forks), base

    def _branches(self, i: int, bp: _BranchPass, drafted: dict[_Key, GrowingDraft], log: PhaseLog) -> Branches:
        compute_ms = (log.phases[-1].end_ns - log.phases[0].start_ns) / 1e6 if log.phases else 0.0
        out = []
        for b, choice in enumerate(bp.choices):
            proposal = drafted[(i, b)].proposal(log)
            if len(proposal):
                out.append(Branch(choice.accepted, choice.token_id, proposal))
        return Branches(tuple(out), compute_ms, log)

    def _sample_rows(
        self,
        group: list[int],
        rest: list[int],
        settings: QSettings,
        probs: Tensor,
        total: np.ndarray,
        active: list[tuple[_Key, _ModelDraftSession]],
        drafted: dict[_Key, GrowingDraft],
        tokens: dict[int, int],
    ) -> None:
        """Build q for rows `group` of probs [R, V or N] (row r is active row rest[r]; total [R] their
        masses) at once, sample from it, record token and q per row."""
        sessions = [active[rest[r]][1] for r in group]
        seeds = torch.tensor([s.params.seed for s in sessions], dtype=torch.int64)  # [G]
        positions = torch.tensor([len(s.kv.tokens) for s in sessions], dtype=torch.int64)  # [G]
        tok, ids, weights = sparse_q.draft(_rows(probs, group), settings, seeds, positions, total[group])  # [G], [G, W]
        if self._host_map is not None:  # same numbers, target ids: q(token_map[j]) = weight j, 0 off the map
            tok, ids = self._host_map[tok], torch.where(weights > 0, self._host_map[ids], 0)
        guessing = [g for g, r in enumerate(group) if (d := drafted[active[rest[r]][0]]).guess_first and not d.tokens]
        if guessing:  # a guess of the target's bonus: at its coin, from the same q (bonus_guess)
            at = torch.tensor(guessing, dtype=torch.int64)
            tok = tok.clone()
            tok[at] = coupled_guess(ids[at], weights[at], seeds[at], positions[at])
        w = weights.numpy()  # [G, W] host, integer-valued
        widths = (w > 0).sum(-1).tolist()  # each row's own width (a prefix of its slots)
        own = ((w * (ids.numpy() == tok.numpy()[:, None])).sum(-1) / w.sum(-1)).tolist()  # [G] q(token)
        for g, r in enumerate(group):  # nothing below can fail: a retry never records a row twice
            d = drafted[active[rest[r]][0]]
            d.q_ids.append(ids[g, : widths[g]])
            d.q_probs.append(weights[g, : widths[g]])
            d.confidence.append(own[g])
            tokens[rest[r]] = int(tok[g])

    def _column(self, token: int) -> int:
        """A target token id -> its logit column (a reduced head: its row in token_map)."""
        if self.token_map is None:
            return token
        hit = (self.token_map == token).nonzero()
        if not len(hit):
            raise InvalidArgument(f"token {token} is not in the draft's reduced vocabulary")
        return int(hit[0, 0])

    def _target_id(self, index: Tensor | int) -> int:
        """A logit column index -> the target token id it stands for."""
        return int(index) if self.token_map is None else int(self.token_map[int(index)])


def _stacked(rows: Sequence[Tensor]) -> Tensor:
    """A x [1, V] -> [A, V]: a view when they are consecutive rows of one tensor (a batched forward's
    split output, as both runners return it), else one copy."""
    first = rows[0]
    step = first.stride(0)
    if (
        first.dim() == 2
        and first.shape[0] == 1
        and first.stride(1) == 1
        and all(
            r.shape == first.shape
            and r.stride() == first.stride()
            and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and r.storage_offset() == first.storage_offset() + i * step
            for i, r in enumerate(rows)
        )
    ):
        return first.as_strided((len(rows), first.shape[1]), (step, 1))
    return torch.cat(list(rows))


def _rows(x: Tensor, rows: list[int]) -> Tensor:
    """x[rows] along the first dimension; x itself when that is every row in order (no copy)."""
    if rows == list(range(x.shape[0])):
        return x
    return x[torch.tensor(rows, dtype=torch.int64, device=x.device)]
