"""The model drafter's trees: EAGLE-2-style expansion within a node budget, one batched tree pass per depth.

At each depth the draft model reads the logits after every frontier node in
ONE tree forward over all sessions (CausalLMRunner.tree_logits_batch on the
tree grown so far: the prefix's uncached tail and the earlier nodes run
again, which keeps the draft session's cache at the committed prefix).
Then the frontier's `beam` nodes of highest path probability are expanded
with `width` children each:

- greedy (T = 0), EAGLE-2: every child of an expanded node joins the tree
  being grown (up to beam x width a level, the pass tree capped at a few
  budgets), the `beam` likeliest of them are the next frontier, and at the
  end the `budget` nodes of highest path probability are kept (a child is
  never likelier than its parent, so they form a tree). Any tree is exact at
  T = 0: the greedy verdict reads the target's argmax. The rerank lets the
  budget go where the draft is unsure (several siblings at a shallow depth)
  or sure (one long path), which a per-level quota cannot;
- sampled (T > 0): up to beam x width new nodes a level while the budget
  lasts, leaving one node for each level still to come, handed to the
  `beam` likeliest frontier nodes one at a time where a child adds the most
  expected acceptance (`children_counts`, at most `width` each); each
  node's first child from the sparse q the chain drafter would send there,
  the others without replacement from that q at half its temperature
  (`sharpened`), one batched draw per level (TreeBuilder.draw_level).
  Where to draw and how many is decided from what was drawn before, and
  every drawn child is kept, so no rerank here (docs/trees.md, "The
  drafter's duty").

A tree with width 1 is the chain drafter's proposal, token for token.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specd.core.draft.model_drafter import ModelDrafter, _ModelDraftSession
from specd.core.errors import Internal, InvalidArgument
from specd.core.rounds.steps import TreeProposeRequest, check_tree_budget
from specd.core.sampling import sampler, sparse_q
from specd.core.sampling.greedy import greedy_tokens
from specd.core.sampling.sampler import UNUSABLE_LOGITS
from specd.core.sampling.tree import DraftTree
from specd.core.sampling.tree_draft import TreeBuilder

DEFAULT_TREE_WIDTH = 6  # children per expanded node
DEFAULT_TREE_BEAM = 4  # nodes expanded per depth
_PASS_BUDGETS = 3  # greedy: the tree being grown holds up to this many budgets of candidates ...
_PASS_NODES_MAX = 128  # ... and never more nodes than this (one draft pass reruns them all)
SHARP_GRID = float(1 << 18)  # a sharpened q's top weight (integers: the compact wire form carries them)


@dataclass
class _Growing:
    """One session's tree under construction."""

    session: _ModelDraftSession
    builder: TreeBuilder
    budget: int  # nodes the proposal may have
    depth: int  # levels at most
    frontier: list[int] = field(default_factory=lambda: [-1])  # nodes to expand next (-1: the prefix)
    score: dict[int, float] = field(default_factory=lambda: {-1: 0.0})  # node -> log path probability

    @property
    def room(self) -> int:
        """Nodes the tree being grown may still take: the budget when sampling (every draw is kept),
        a few budgets when greedy (the final rerank keeps `budget` of them)."""
        cap = self.budget if not self.session.params.is_greedy else min(_PASS_NODES_MAX, _PASS_BUDGETS * self.budget)
        return cap - len(self.builder)

    def partial(self) -> DraftTree:
        return DraftTree(tuple(self.builder.token_ids), tuple(self.builder.parents))  # no q: for the forward only

    def result(self, vocab_size: int) -> DraftTree:
        """The proposal: sampled, the tree as drawn; greedy, its `budget` nodes of highest path probability."""
        if not self.session.params.is_greedy or len(self.builder) <= self.budget:
            return self.builder.build(vocab_size, checked=False)
        b = self.builder
        # Likeliest first; a parent before its children at equal score (depth), then drafting order.
        order = sorted(range(len(b)), key=lambda n: (-self.score[n], b.depth_of(n), n))
        kept: set[int] = set()
        for n in order:
            if len(kept) == self.budget:
                break
            if b.parents[n] < 0 or b.parents[n] in kept:
                kept.add(n)
        pruned = TreeBuilder(b.seed, b.start_position)
        index: dict[int, int] = {-1: -1}
        for n in sorted(kept):  # drafting order is topological
            index[n] = pruned.add(index[b.parents[n]], b.token_ids[n])
        return pruned.build(vocab_size, checked=False)


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
            active = [i for i, g in growing.items() if g.room > 0 and g.frontier and level <= g.depth]
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
            out[i] = g.result(drafter.vocab_size)
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


def sharpened(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse q at half its temperature, q^2 renormalised, on the same grid: (ids, weights) [P, W].

    Where later siblings come from. After the first child's rejection the
    recursive rule looks for the residual max(0, p - q), which sits where the
    target is surer than the draft, mostly on the draft's own top tokens: a
    sharper q puts siblings there. Emulated 70B pair, agreement 0.8, T = 0.7,
    P(one of 1, 2, 3, 4 children accepted) over 300 contexts x 10 seeds
    (scripts/tree_siblings.py): siblings from q 0.754, 0.846, 0.885, 0.909;
    from q at half the temperature 0.754, 0.893, 0.924, 0.935.
    Any q is exact as long as the child is drawn from the q it records.
    Integer weights on the wire's grid (the top one 2**18), zero where they round to 0.
    """
    w = weights.to(torch.float64)
    sq = w * w
    top = sq.max(-1, keepdim=True).values
    grid = torch.where(top > 0, torch.floor(sq / torch.where(top > 0, top, 1.0) * SHARP_GRID + 0.5), 0.0)
    return ids.clone(), grid.to(torch.float32)


def children_counts(scores: Sequence[float], weights: np.ndarray, width: int, allowance: int) -> list[int]:
    """How many children each parent of a sampled level draws: `allowance` in all, at most `width` each.

    scores: [P] each parent's log path probability under q; weights: [P, W] each parent's sparse q,
    slots by decreasing weight (sparse_q.build). One child at a time goes where it adds the most
    expected acceptance, taken as the parent's path probability times the q mass of the parent's
    next-likeliest token not yet given a child (the c-th child mostly lands on the c-th token).
    Handing the whole allowance to the likeliest parent first (as before) put a two-level tree's
    second level under one node: on emulated h100-8b, agreement 0.8, T = 0.7, a 12-node tree
    reached 2.52 tokens a round against a 3-token chain's 2.64 (scripts/tree_acceptance.py).
    Exact whatever it returns: it reads the parents' q rows and the draws before this level, never a
    child's value or the target's coins.
    """
    mass = weights.astype(np.float64)
    mass = mass / np.maximum(mass.sum(-1, keepdims=True), 1e-300)  # [P, W]
    support = (weights > 0).sum(-1)  # [P] a row cannot give more children than it has tokens
    caps = [min(width, int(n)) for n in support]
    counts = [0] * len(scores)
    heap = [(-math.exp(sc) * mass[r, 0], r) for r, sc in enumerate(scores) if caps[r] > 0]
    heapq.heapify(heap)  # ties: the earlier parent (likelier path) first
    for _ in range(allowance):
        if not heap:
            break
        _, r = heapq.heappop(heap)
        counts[r] += 1
        c = counts[r]
        if c < caps[r]:
            heapq.heappush(heap, (-math.exp(scores[r]) * mass[r, c], r))
    return counts


def _expand(drafter: ModelDrafter, g: _Growing, logits: torch.Tensor, width: int, beam: int) -> None:
    """Grow g by one level from its tree pass's logits [N+1, V] (row 1 + i after node i, row 0 after the prefix)."""
    parents = sorted(g.frontier, key=lambda n: -g.score[n])[:beam]  # highest path probability first
    level = g.builder.depth_of(parents[0]) + 1
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
        for score, p, t in cands[: g.room]:  # all of them join; result() reranks
            node = g.builder.add(p, t)
            g.score[node] = score
            new.append(node)
        g.frontier = new[:beam]  # the likeliest children are expanded next
        if g.frontier and len(g.builder) >= g.budget:
            # No deeper node can outscore its ancestor: once the best frontier node ranks below the
            # budget-th best so far, another level (a draft pass) could not change the proposal.
            kth = sorted((g.score[n] for n in range(len(g.builder))), reverse=True)[g.budget - 1]
            if g.score[g.frontier[0]] < kth:
                g.frontier = []
        return
    # Sampled: at most beam x width new nodes, leaving one per level still to come so the tree
    # reaches its depth. Counts only, never the children's values: every child drawn is kept.
    allowance = max(1, min(beam * width, g.room - (g.depth - level)))
    probs = sampler.processed_probs(rows[:, None, :], [g.session.params] * len(parents))  # [P, 1, V]
    unusable = sampler.unusable_rows(rows[:, None, :], probs)
    if unusable:
        raise next(iter(unusable.values()))
    ids, weights = sparse_q.build(probs[:, 0], g.session.q)  # [P, W] the q the chain drafter would send
    counts = children_counts([g.score[p] for p in parents], weights.numpy(), width, allowance)
    drawing = [r for r, c in enumerate(counts) if c > 0]
    if not drawing:
        g.frontier = []
        return
    chosen = [parents[r] for r in drawing]
    # Each parent's first child from the chain's q (a width-1 tree is the chain), the later ones
    # without replacement from that q sharpened (see `sharpened`).
    sharp = sharpened(ids[drawing], weights[drawing])[1] if any(counts[r] > 1 for r in drawing) else None
    nodes = g.builder.draw_level(chosen, ids[drawing], weights[drawing], [counts[r] for r in drawing], later=sharp)
    # Each child's score: its parent's plus the log of its token's mass in the parent's full q.
    w64 = weights[drawing].to(torch.float64).numpy()  # [P', W]
    mass, id_rows = w64 / w64.sum(-1, keepdims=True), ids[drawing].numpy()
    for j, (r, kids) in enumerate(zip(drawing, nodes)):
        for node in kids:
            m = float(mass[j][id_rows[j] == g.builder.token_ids[node]].sum())  # ids may repeat
            g.score[node] = g.score[parents[r]] + math.log(max(m, 1e-30))
            new.append(node)
    g.frontier = new
