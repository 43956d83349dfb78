"""The model drafter's trees: EAGLE-2-style expansion within a node budget, one batched tree pass per depth.

At each depth the draft model reads the logits after every frontier node in
ONE tree forward over all sessions (CausalLMRunner.tree_logits_batch on the
tree grown so far: the prefix's uncached tail and the earlier nodes run
again, which keeps the draft session's cache at the committed prefix).
Then the frontier's `beam` nodes of highest path probability are expanded,
adding at most `beam` nodes per level and leaving one node of the budget for
each level still to come:

- greedy (T = 0): each proposes its `width` likeliest tokens under the
  draft's softmax, and of all these the ones of highest path probability are
  kept while the budget lasts (EAGLE-2's reranking; any tree is exact at
  T = 0, the greedy verdict reads the target's argmax);
- sampled (T > 0): each draws `width` children without replacement from the
  sparse q the chain drafter would send there (TreeBuilder.draw, coin slots
  per depth), parents in order of path probability while the budget lasts.
  Where to draw and how many is decided from what was drawn before; every
  drawn child is kept (docs/trees.md, "The drafter's duty"). A tree with
  width 1 is the chain drafter's proposal, token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specd.core.draft.model_drafter import ModelDrafter, _ModelDraftSession
from specd.core.errors import Internal, InvalidArgument
from specd.core.rounds.steps import TreeProposeRequest, check_tree_budget
from specd.core.sampling import sampler, sparse_q
from specd.core.sampling.greedy import greedy_tokens
from specd.core.sampling.sampler import UNUSABLE_LOGITS
from specd.core.sampling.tree import DraftTree
from specd.core.sampling.tree_draft import TreeBuilder

DEFAULT_TREE_WIDTH = 3  # children per expanded node
DEFAULT_TREE_BEAM = 4  # nodes expanded per depth


@dataclass
class _Growing:
    """One session's tree under construction."""

    session: _ModelDraftSession
    builder: TreeBuilder
    budget: int  # nodes left
    depth: int  # levels at most
    frontier: list[int] = field(default_factory=lambda: [-1])  # nodes of the last level (-1: the prefix)
    score: dict[int, float] = field(default_factory=lambda: {-1: 0.0})  # node -> log path probability

    def partial(self) -> DraftTree:
        return DraftTree(tuple(self.builder.token_ids), tuple(self.builder.parents))  # no q: for the forward only


def model_trees(
    drafter: ModelDrafter,
    requests: Sequence[TreeProposeRequest],
    *,
    width: int = DEFAULT_TREE_WIDTH,
    beam: int = DEFAULT_TREE_BEAM,
) -> list[DraftTree | Exception]:
    """Draft one tree per request (see the module docstring); per-request errors in their slots."""
    if width < 1 or beam < 1:
        raise InvalidArgument(f"tree width and beam must be >= 1 (got {width}, {beam})")
    out: list[DraftTree | Exception] = [Internal("not drafted")] * len(requests)
    growing: dict[int, _Growing] = {}
    for i, req in enumerate(requests):
        try:
            growing[i] = _prepare(drafter, req)
        except Exception as exc:  # noqa: BLE001 - this request's error, in its slot
            out[i] = exc
    with torch.inference_mode():
        for level in range(1, max((g.depth for g in growing.values()), default=0) + 1):
            active = [i for i, g in growing.items() if g.budget > 0 and g.frontier and level <= g.depth]
            if not active:
                break
            try:
                results = drafter.runner.tree_logits_batch(
                    [growing[i].session.kv for i in active], [growing[i].partial() for i in active]
                )
            except Exception as exc:  # noqa: BLE001 - the shared forward failed: every request in it fails
                for i in active:
                    out[i] = exc
                    del growing[i]
                continue
            for i, res in zip(active, results):
                try:
                    _expand(drafter, growing[i], res.logits, width, beam)
                except Exception as exc:  # noqa: BLE001 - this row could not be sampled: its request alone
                    out[i] = exc
                    del growing[i]
    for i, g in growing.items():
        try:
            out[i] = g.builder.build(drafter.vocab_size)
        except Exception as exc:  # noqa: BLE001 - reported in its slot
            out[i] = exc
    return out


def _prepare(drafter: ModelDrafter, req: TreeProposeRequest) -> _Growing:
    check_tree_budget(req.budget, req.depth)
    if drafter.token_map is not None:
        raise InvalidArgument("tree drafting does not support a reduced-vocabulary draft head yet; draft chains")
    s = drafter._pool.get(req.session_id)
    drafter._sync(s, req.committed_length, req.start, req.tail)
    depth = min(req.depth, drafter.runner.max_context - req.committed_length)
    if depth < 1:
        raise InvalidArgument("the session fills the draft model's context; nothing left to draft")
    return _Growing(s, TreeBuilder(s.params.seed, req.committed_length), req.budget, depth)


def _expand(drafter: ModelDrafter, g: _Growing, logits: torch.Tensor, width: int, beam: int) -> None:
    """Grow g by one level from its tree pass's logits [N+1, V] (row 1 + i after node i, row 0 after the prefix)."""
    parents = sorted(g.frontier, key=lambda n: -g.score[n])[:beam]  # highest path probability first
    # New nodes this level: at most `beam`, leaving one per level still to come so the tree reaches its
    # depth. Counts only, never the children's values: at T > 0 every child drawn is kept.
    level = g.builder.depth_of(parents[0]) + 1
    allowance = max(1, min(beam, g.budget - (g.depth - level)))
    rows = logits[[n + 1 for n in parents]].float()  # [P, V]
    new: list[int] = []
    if g.session.params.is_greedy:
        if bool(greedy_tokens(rows)[1].any()):
            raise Internal(UNUSABLE_LOGITS)
        logp = torch.log_softmax(rows, -1)
        top = torch.topk(logp, min(width, rows.shape[-1]), -1)  # [P, width]
        cands = [
            (g.score[p] + float(v), p, int(t))
            for r, p in enumerate(parents)
            for v, t in zip(top.values[r].tolist(), top.indices[r].tolist())
        ]
        cands.sort(key=lambda c: -c[0])  # stable: a parent's own order breaks ties
        for score, p, t in cands[:allowance]:
            node = g.builder.add(p, t)
            g.score[node] = score
            new.append(node)
    else:
        probs = sampler.processed_probs(rows[:, None, :], [g.session.params] * len(parents))  # [P, 1, V]
        unusable = sampler.unusable_rows(rows[:, None, :], probs)
        if unusable:
            raise next(iter(unusable.values()))
        ids, weights = sparse_q.build(probs[:, 0], g.session.q)  # [P, W] the q the chain drafter would send
        for r, p in enumerate(parents):
            k = min(width, allowance - len(new))
            if k <= 0:
                break
            total = float(weights[r].sum())
            for node in g.builder.draw(p, ids[r], weights[r], k):
                mass = float(weights[r][ids[r] == g.builder.token_ids[node]].sum()) / total
                g.score[node] = g.score[p] + math.log(max(mass, 1e-30))
                new.append(node)
    g.budget -= len(new)
    g.frontier = new
