"""A tree round's drafting: each drafter's draft tree for a TreeProposeRequest.

The model drafter expands its own distribution (specd.core.draft.model_tree).
The n-gram and suffix drafters have candidates, not a distribution: several
continuations, merged into a trie of one-hot nodes (TreeBuilder.add), exact
as any candidate chosen independently of the target's coins. A drafter of
another kind is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.model_tree import DEFAULT_TREE_BEAM, DEFAULT_TREE_WIDTH, model_trees
from specd.core.draft.protocol import Drafter
from specd.core.errors import InvalidArgument
from specd.core.rounds.steps import TreeProposeRequest
from specd.core.sampling.tree import DraftTree
from specd.core.sampling.tree_draft import TreeBuilder


@runtime_checkable
class CandidateDrafter(Protocol):
    """A drafter with several one-hot continuations per round (n-gram, suffix)."""

    vocab_size: int

    def candidates(self, request: TreeProposeRequest) -> list[list[int]]: ...


def candidate_tree(candidates: Sequence[Sequence[int]], budget: int, depth: int, vocab_size: int) -> DraftTree:
    """The trie of the candidates (earlier ones first among siblings), cut at `depth` levels and `budget` nodes."""
    builder = TreeBuilder(seed=0, start_position=0)  # no draws: nodes are added, not sampled
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for cand in candidates:
        parent = -1
        for token in list(cand)[:depth]:
            node = child.get((parent, int(token)))
            if node is None:
                if len(builder) >= budget:
                    break
                node = builder.add(parent, int(token))
                child[(parent, int(token))] = node
            parent = node
    return builder.build(vocab_size)


def propose_trees(
    drafter: Drafter,
    requests: Sequence[TreeProposeRequest],
    *,
    width: int = DEFAULT_TREE_WIDTH,
    beam: int = DEFAULT_TREE_BEAM,
) -> list[DraftTree | Exception]:
    """One draft tree per request, batched where the drafter has a model; errors in their slots.

    width, beam: the model drafter's expansion (children per expanded node, nodes expanded per depth)."""
    if isinstance(drafter, ModelDrafter):
        return model_trees(drafter, requests, width=width, beam=beam)
    if not isinstance(drafter, CandidateDrafter):
        kind = getattr(drafter, "kind", type(drafter).__name__)
        raise InvalidArgument(f"the {kind} drafter cannot draft trees; use the model, suffix or n-gram drafter")
    out: list[DraftTree | Exception] = []
    for req in requests:
        try:
            found = drafter.candidates(req)
            out.append(candidate_tree(found, req.budget, req.depth, drafter.vocab_size))
        except Exception as exc:  # noqa: BLE001 - this request's error, in its slot
            out.append(exc)
    return out
