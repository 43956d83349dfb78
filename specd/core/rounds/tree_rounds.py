"""Tree rounds (docs/trees.md): draft a tree, verify it in one pass, commit the accepted path and one token.

Many requests run in lockstep, each round one batched tree draft and one
batched tree verify over the requests still going; outcomes do not depend
on the batch (coins hash (seed, position)). No pipelining: a tree round's
next draft waits for its verdict. The draft's sequence stays at the
committed prefix (a tree's nodes do not join it), so each round's draft call
rolls it to the last round's prefix and appends what that round committed.

Records: a round's draft_token_ids are the tree's nodes (node order), its
`accepted` the accepted path's length, so RoundStats' acceptance rate is
accepted nodes per drafted node and accepted_per_position counts depths.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specd.core.errors import InvalidArgument
from specd.core.rounds.generation import Generation
from specd.core.rounds.record import RoundRecord, TargetOnly, TokenKind
from specd.core.rounds.steps import TreeProposeRequest, TreeVerifyOutcome, TreeVerifyRequest
from specd.core.sampling.tree import DraftTree

# One batched step each: errors in their slots (a request's error ends that request with it raised).
ProposeTrees = Callable[[Sequence[TreeProposeRequest]], Sequence[DraftTree | Exception]]
VerifyTrees = Callable[[Sequence[TreeVerifyRequest]], Sequence[TreeVerifyOutcome | Exception]]

EMPTY_TREE = DraftTree((), ())


@dataclass
class TreeRun:
    """One request's tree rounds: its generation, session, and where its draft's sequence stands."""

    generation: Generation
    session_id: str
    depth: int  # tree levels at most (the chain's K)
    draft_start: int  # the draft's sequence: the first draft_start tokens are committed ...
    draft_tail: list[int] = field(default_factory=list)  # ... and these follow (committed since)
    records: list[RoundRecord] = field(default_factory=list)


def run_tree_rounds(
    runs: Sequence[TreeRun],
    propose: ProposeTrees | None,
    verify: VerifyTrees,
    *,
    budget: int,
) -> None:
    """Run every request's rounds until each is done. propose None: target-only (empty trees).

    budget: nodes per tree at most; a run's depth: levels at most (cut by what it may still commit).
    """
    if budget < 1:
        raise InvalidArgument(f"tree rounds need a budget of >= 1 node (got {budget})")
    while True:
        active = [r for r in runs if not r.generation.done]
        if not active:
            return
        t0 = time.perf_counter()
        levels = [r.generation.draft_budget(r.depth) for r in active]
        trees: list[DraftTree] = [EMPTY_TREE] * len(active)
        asking = [a for a, k in enumerate(levels) if k > 0 and propose is not None]
        if asking and propose is not None:
            requests = [_propose_request(active[a], budget, levels[a]) for a in asking]
            for a, tree in zip(asking, propose(requests)):
                if isinstance(tree, Exception):
                    raise tree
                trees[a] = tree
                active[a].draft_start, active[a].draft_tail = active[a].generation.committed_length, []
        t1 = time.perf_counter()
        verdicts = verify(
            [
                TreeVerifyRequest(r.session_id, r.generation.committed_length, t, start=r.generation.committed_length)
                for r, t in zip(active, trees)
            ]
        )
        t2 = time.perf_counter()
        for a, (r, tree, out) in enumerate(zip(active, trees, verdicts)):
            if isinstance(out, Exception):
                raise out
            before = r.generation.committed_length
            committed = r.generation.commit(out.tokens, out.accepted, out.token_id)
            r.draft_tail.extend(committed)
            reason = None if len(tree) else (TargetOnly.BUDGET if levels[a] == 0 else _why_empty(propose))
            r.records.append(
                RoundRecord(
                    index=len(r.records),
                    committed_length=before,
                    draft_length=levels[a],
                    draft_token_ids=tree.token_ids,
                    accepted=out.accepted,
                    token_id=out.token_id,
                    token_kind=TokenKind.BONUS if out.is_bonus else TokenKind.RECOVERED,
                    committed=tuple(committed),
                    wall_ms=(t2 - t0) * 1e3,
                    draft_ms=(t1 - t0) * 1e3 if a in asking else 0.0,
                    verify_ms=out.compute_ms,
                    target_only=reason,
                )
            )


def _propose_request(r: TreeRun, budget: int, depth: int) -> TreeProposeRequest:
    g = r.generation
    if r.draft_start + len(r.draft_tail) != g.committed_length:  # every commit extends the tail
        raise InvalidArgument("the draft's sequence fell out of step with the committed prefix")
    return TreeProposeRequest(r.session_id, g.committed_length, r.draft_start, list(r.draft_tail), budget, depth)


def _why_empty(propose: ProposeTrees | None) -> TargetOnly:
    return TargetOnly.NO_DRAFT if propose is None else TargetOnly.DRAFT_EMPTY
