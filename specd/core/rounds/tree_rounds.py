"""Tree rounds (docs/trees.md): draft a tree, verify it in one pass, commit the accepted path and one token.

The round loop (specd.core.rounds.loop) hands a request with a tree budget
to `TreeRounds`, which runs each of its rounds over the same ports and
sessions as a chain round: one tree call to the draft, one tree verify to
the target. Fixed speculation only (the depth is the request's draft
length). The draft's sequence stays at the committed prefix (a tree's nodes
do not join it), so each tree call rolls it to the last round's prefix and
appends what that round committed (port_sessions.DraftSession tracks it).

Pipelining (pipeline "bonus-match", docs/trees.md "Pipelined trees"): while
the target verifies a tree, the draft grows the next one after the tree's
first path (each node's first child: the drafter's likeliest) with one more
level, whose first-level nodes are its guesses of the bonus token. Hit: the
verdict accepts that whole path and its bonus is one of those guesses; the
next round verifies the subtree under that guess (its first `budget` nodes,
as deep as the round may draft) with no draft latency. The pre-draft is
always awaited before the next draft call (the draft holds one sequence per
session), so whether a round hits depends on the verdict and the draft's
tokens alone, never on timing: the services and the in-process loop emit
the same tokens. Exact: the subtree's nodes were drawn after the committed
prefix by the tree rule, with the draft's coins, which the target's verdict
does not read; choosing it by the target's token picks which valid tree is
verified, not what the verdict on it is. At T > 0 the tokens are not those
of unpipelined tree rounds (another valid tree is verified), their
distribution is.

Exactness is the chain's: a draft that fails, is slow or is missing turns
the round target-only (an empty tree: the target samples the token itself).

Records: a round's draft_token_ids are the tree's nodes (node order), its
`accepted` the accepted path's length (the accepted depth), so RoundStats'
acceptance rate is accepted nodes per drafted node, its acceptance length
1 + mean accepted depth, and accepted_per_position counts rounds per depth.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from specd.core.errors import InvalidArgument
from specd.core.rounds.generation import FinishReason, Generation
from specd.core.rounds.pipeline import BonusMatch, Off
from specd.core.rounds.port_sessions import DraftSession, TargetSession
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import PipelineHit, RoundRecord, TargetOnly, TokenKind
from specd.core.rounds.steps import TreeVerifyOutcome
from specd.core.sampling.tree import DraftTree

T = TypeVar("T")
EMPTY_TREE = DraftTree((), ())
TREE_PIPELINES = (Off.name, BonusMatch.name)  # what a tree request may pipeline with
# A pre-draft's node budget, in budgets: the bonus guesses and their subtrees share it, and the hit's
# subtree keeps at most one budget of it; never more nodes than a draft service takes by default in one
# tree call (its --max-draft-tokens, 32), nor fewer than the request's budget.
PRE_DRAFT_BUDGETS = 3
PRE_DRAFT_MAX_NODES = 32

# RequestRun._draft_call: call(draft session, timeout), or why the draft gave nothing (its failure policy).
DraftCall = Callable[[Callable[[DraftSession, float], Awaitable[DraftTree]]], Awaitable[DraftTree | TargetOnly]]
# Given the tokens a round committed: how many to keep when a stop string ended in them, else None.
StopCheck = Callable[[Sequence[int]], int | None]


def check_tree_request(budget: int, speculation: str, pipeline: str, depth: int) -> None:
    """InvalidArgument unless a tree request is one these rounds run: fixed speculation, pipeline off or
    bonus-match."""
    if budget < 1:
        raise InvalidArgument(f"tree rounds need a budget of >= 1 node (got {budget})")
    if speculation != "fixed":
        raise InvalidArgument(f"tree speculation runs with speculation 'fixed' (got {speculation!r})")
    if pipeline not in TREE_PIPELINES:
        raise InvalidArgument(f"tree speculation runs with pipeline 'off' or 'bonus-match' (got {pipeline!r})")
    if depth < 1:
        raise InvalidArgument(f"a tree's depth (the draft length) must be >= 1 (got {depth})")


@dataclass(frozen=True)
class _PreDraft:
    """A pre-draft call beside a verify: the first path it assumes accepted, and the call."""

    path: tuple[int, ...]  # node indices of the tree being verified
    tokens: tuple[int, ...]  # their tokens
    call: asyncio.Future[DraftTree | TargetOnly]


@dataclass(frozen=True)
class _Ready:
    """The next round's tree, from a pre-draft that hit."""

    committed_length: int  # the prefix it was drafted after
    tree: DraftTree
    hit: PipelineHit


class TreeRounds:
    """One request's tree rounds over its draft and target sessions."""

    def __init__(
        self,
        generation: Generation,
        budget: int,
        depth: int,
        target: TargetSession,
        draft: DraftSession | None,
        draft_usable: Callable[[], Awaitable[bool]],
        draft_call: DraftCall,
        on_retry: Callable[[BaseException], None],
        stop: StopCheck | None = None,
        deadline: float = math.inf,
        pipeline: str = Off.name,
    ) -> None:
        self.generation = generation
        self.budget = budget  # nodes per tree at most
        self.depth = depth  # levels at most (cut by what the request may still commit)
        self.pipeline = pipeline
        self._target = target
        self._draft = draft
        self._draft_usable = draft_usable
        self._draft_call = draft_call
        self._on_retry = on_retry
        self._stop = stop
        self._deadline = deadline
        self._ready: _Ready | None = None

    async def round(self, index: int, carrier: Carrier) -> RoundRecord:
        gen = self.generation
        t0 = time.perf_counter()
        committed = gen.committed
        levels = gen.draft_budget(self.depth)
        tree, why, hit = EMPTY_TREE, None, None
        draft_ms = 0.0
        ready, self._ready = self._ready, None
        if levels == 0:
            why = TargetOnly.BUDGET
        elif ready is not None and ready.committed_length == len(committed):
            tree, hit = ready.tree, ready.hit
        elif self._draft is None:
            why = TargetOnly.NO_DRAFT
        elif not await self._draft_usable():
            why = TargetOnly.DRAFT_UNAVAILABLE
        else:
            t_draft = time.perf_counter()
            result = await self._draft_call(
                lambda d, timeout: d.propose_tree(committed, self.budget, levels, timeout=timeout, carrier=carrier)
            )
            draft_ms = (time.perf_counter() - t_draft) * 1e3
            if isinstance(result, TargetOnly):
                why = result
            else:
                tree, why = result, None if len(result) else TargetOnly.DRAFT_EMPTY
        verifying = asyncio.ensure_future(
            self._target.verify_tree(committed, tree, deadline=self._deadline, carrier=carrier, on_retry=self._on_retry)
        )
        pre = self._pre_draft(committed, tree, carrier)
        try:
            outcome = await verifying
        except BaseException:
            verifying.cancel()
            if pre is not None:
                pre.call.cancel()
                await asyncio.gather(pre.call, return_exceptions=True)
            raise
        new = gen.commit(outcome.tokens, outcome.accepted, outcome.token_id)
        if self._stop is not None:
            keep = self._stop(new)
            if keep is not None:
                gen.finish(FinishReason.STOP_STRING, keep=len(gen.generated) - len(new) + keep)
                new = new[:keep]
        if pre is not None:
            self._ready = await self._settle(pre, outcome)
        return RoundRecord(
            index=index,
            committed_length=len(committed),
            draft_length=levels,
            draft_token_ids=tree.token_ids,
            accepted=outcome.accepted,
            token_id=outcome.token_id,
            token_kind=TokenKind.BONUS if outcome.is_bonus else TokenKind.RECOVERED,
            committed=tuple(new),
            wall_ms=(time.perf_counter() - t0) * 1e3,
            draft_ms=draft_ms,
            verify_ms=outcome.compute_ms,
            target_only=None if len(tree) else why,
            pipeline_hit=hit,
            pipeline_launched=int(pre is not None),
            pipeline=self.pipeline,
        )

    def _pre_draft(self, committed: Sequence[int], tree: DraftTree, carrier: Carrier) -> _PreDraft | None:
        """The next tree, grown beside the verify after `tree`'s first path and a guess of its bonus;
        None without a pipeline, a tree, or a next round that drafts."""
        if self.pipeline == Off.name or not len(tree) or self._draft is None:
            return None
        path = tree.first_path()
        levels = self.generation.draft_budget(self.depth, after=len(path) + 1)
        if levels == 0:
            return None
        tokens = tuple(tree.token_ids[i] for i in path)
        budget = max(self.budget, min(PRE_DRAFT_BUDGETS * self.budget, PRE_DRAFT_MAX_NODES))
        call = asyncio.ensure_future(
            self._draft_call(
                lambda d, timeout: d.propose_tree(
                    committed, budget, levels + 1, timeout=timeout, carrier=carrier, extension=tokens
                )
            )
        )
        return _PreDraft(tuple(path), tokens, call)

    async def _settle(self, pre: _PreDraft, outcome: TreeVerifyOutcome) -> _Ready | None:
        """The next round's tree if the pre-draft hit: the verdict accepted its whole path and its token is
        one of the pre-draft's first-level guesses. The draft is busy with the pre-draft either way (its
        calls run in order), so it is awaited unless the request is over."""
        gen = self.generation
        if gen.done:
            pre.call.cancel()
            await asyncio.gather(pre.call, return_exceptions=True)
            return None
        grown = await pre.call
        if isinstance(grown, TargetOnly) or tuple(outcome.path) != pre.path:
            return None
        guess = next((i for i in grown.children[0] if grown.token_ids[i] == outcome.token_id), None)
        levels = gen.draft_budget(self.depth)
        if guess is None or levels == 0:
            return None
        tree = grown.subtree(guess, self.budget, levels)
        if not len(tree):
            return None
        kind = TokenKind.BONUS if outcome.is_bonus else TokenKind.RECOVERED
        return _Ready(gen.committed_length, tree, PipelineHit(self.pipeline, outcome.accepted, kind, 1))
