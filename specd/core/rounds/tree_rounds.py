"""Tree rounds (docs/trees.md): draft a tree, verify it in one pass, commit the accepted path and one token.

The round loop (specd.core.rounds.loop) hands a request with a tree budget
to `TreeRounds`, which runs each of its rounds over the same ports and
sessions as a chain round: one tree call to the draft, one tree verify to
the target. Fixed speculation only (the depth is the request's draft
length), no pipelining: a tree round's next draft waits for its verdict.
The draft's sequence stays at the committed prefix (a tree's nodes do not
join it), so each tree call rolls it to the last round's prefix and appends
what that round committed (port_sessions.DraftSession tracks it).

Exactness is the chain's: a draft that fails, is slow or is missing turns
the round target-only (an empty tree: the target samples the token itself).

Records: a round's draft_token_ids are the tree's nodes (node order), its
`accepted` the accepted path's length (the accepted depth), so RoundStats'
acceptance rate is accepted nodes per drafted node, its acceptance length
1 + mean accepted depth, and accepted_per_position counts rounds per depth.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from specd.core.errors import InvalidArgument
from specd.core.rounds.generation import FinishReason, Generation
from specd.core.rounds.port_sessions import DraftSession, TargetSession
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import RoundRecord, TargetOnly, TokenKind
from specd.core.sampling.tree import DraftTree

T = TypeVar("T")
EMPTY_TREE = DraftTree((), ())

# RequestRun._draft_call: call(draft session, timeout), or why the draft gave nothing (its failure policy).
DraftCall = Callable[[Callable[[DraftSession, float], Awaitable[DraftTree]]], Awaitable[DraftTree | TargetOnly]]
# Given the tokens a round committed: how many to keep when a stop string ended in them, else None.
StopCheck = Callable[[Sequence[int]], int | None]


def check_tree_request(budget: int, speculation: str, pipeline: str, depth: int) -> None:
    """InvalidArgument unless a tree request is one these rounds run: fixed speculation, pipeline off."""
    if budget < 1:
        raise InvalidArgument(f"tree rounds need a budget of >= 1 node (got {budget})")
    if speculation != "fixed":
        raise InvalidArgument(f"tree speculation runs with speculation 'fixed' (got {speculation!r})")
    if pipeline != "off":
        raise InvalidArgument(f"tree speculation runs with pipeline 'off' (got {pipeline!r})")
    if depth < 1:
        raise InvalidArgument(f"a tree's depth (the draft length) must be >= 1 (got {depth})")


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
    ) -> None:
        self.generation = generation
        self.budget = budget  # nodes per tree at most
        self.depth = depth  # levels at most (cut by what the request may still commit)
        self._target = target
        self._draft = draft
        self._draft_usable = draft_usable
        self._draft_call = draft_call
        self._on_retry = on_retry
        self._stop = stop
        self._deadline = deadline

    async def round(self, index: int, carrier: Carrier) -> RoundRecord:
        gen = self.generation
        t0 = time.perf_counter()
        committed = gen.committed
        levels = gen.draft_budget(self.depth)
        tree, why = EMPTY_TREE, None
        draft_ms = 0.0
        if levels == 0:
            why = TargetOnly.BUDGET
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
        outcome = await self._target.verify_tree(
            committed, tree, deadline=self._deadline, carrier=carrier, on_retry=self._on_retry
        )
        new = gen.commit(outcome.tokens, outcome.accepted, outcome.token_id)
        if self._stop is not None:
            keep = self._stop(new)
            if keep is not None:
                gen.finish(FinishReason.STOP_STRING, keep=len(gen.generated) - len(new) + keep)
                new = new[:keep]
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
        )
