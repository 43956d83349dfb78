"""A draft token tree: what a drafter proposes when it keeps its second and third guesses.

A chain of K draft tokens dies at its first rejection; a tree keeps several
candidates per position, so one target pass can keep a longer prefix.

Nodes are in topological order. Node i has a token id, a parent index
(-1: a child of the committed prefix's last token; otherwise an earlier node,
parents[i] < i) and, optionally, the sparse q it was drawn from, in the
convention of :class:`specd.core.sampling.rejection.SparseProposal`: ids and
wire probabilities, q = probs / probs.sum() in float64 (no q: one-hot at the
node's token, as for n-gram and suffix drafts). A chain is the tree where
every parent is the previous node.

Words: a node's **depth** is the number of nodes on its path from the
committed prefix, itself included (a child of the prefix has depth 1; a chain
of K nodes has depth K); its absolute position is committed length + depth - 1.
Its **rank** is its index among its parent's children, in node order.

Coins: every coin of a tree round is :func:`specd.core.sampling.sampler.coins`
at a *coin position* ``position + slot * COIN_STRIDE`` (:func:`coin_positions`):
slot 0 is the chain's coin, so a chain verifies exactly as
:func:`specd.core.sampling.rejection.rejection_sample` does, and slots
1, 2, ... are further independent streams at the same token position. Token
positions stay far below COIN_STRIDE (2**32), so no slot collides with
another position's coin.

`DraftTree` is one validated tree (from the wire or a drafter); `TreeBatch` is
B trees padded into tensors for the batched verifier
(specd.core.sampling.tree_rejection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling.proposal import DEFAULT_MAX_Q_WIDTH, QRow, check_row_width, checked_tokens

__all__ = [
    "COIN_STRIDE",
    "DEFAULT_MAX_TREE_DEPTH",
    "DEFAULT_MAX_TREE_NODES",
    "DraftTree",
    "TreeBatch",
    "coin_positions",
]

# What a tree from the wire may hold unless the service says otherwise: nodes (the
# chain's DEFAULT_MAX_DRAFT_TOKENS) and levels. With DEFAULT_MAX_Q_WIDTH entries per q
# row, the dense q a message can make anyone allocate stays at 256 x 4096 x 12 bytes.
DEFAULT_MAX_TREE_NODES = 256
DEFAULT_MAX_TREE_DEPTH = 64
# Coin slots at one token position are this far apart in coin-position space.
COIN_STRIDE = 1 << 32


def coin_positions(positions: Tensor, slots: Tensor | int) -> Tensor:
    """[B] int64 token positions, [B] (or one) int64 slots -> [B] coin positions (slot 0: the chain's)."""
    return positions.to(torch.int64) + torch.as_tensor(slots, dtype=torch.int64, device=positions.device) * COIN_STRIDE


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One draft tree, validated (build it with `from_wire` or `chain`)."""

    token_ids: tuple[int, ...]  # [N]
    parents: tuple[int, ...]  # [N] -1 or an earlier node's index
    q_ids: Tensor | None = None  # [N, W] int64 (unused slots: id 0, prob 0)
    q_probs: Tensor | None = None  # [N, W] float32 wire values; None: one-hot q at each token
    # Instead of q_ids/q_probs: per node, q exactly as it arrived from a draft, relayed to the
    # target undecoded (the coordinator never reads q's numbers; the target validates them).
    wire_q: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    @staticmethod
    def from_wire(
        token_ids: Sequence[int],
        parents: Sequence[int],
        q: Sequence[QRow],
        vocab_size: int,
        *,
        max_nodes: int = DEFAULT_MAX_TREE_NODES,
        max_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_q_width: int = DEFAULT_MAX_Q_WIDTH,
    ) -> DraftTree:
        """Build and validate a tree from per-node lists; `q` holds one (ids, probs) row per node, or none.

        Sizes are checked first, from lengths and the parent list alone, before
        any tensor is allocated: at most max_nodes nodes, at most max_depth
        levels, and at most min(max_q_width, vocab_size) entries per q row.
        """
        n = len(token_ids)
        _require(n <= max_nodes, f"a draft tree of {n} nodes; this service verifies at most {max_nodes}")
        _require(len(parents) == n, f"a draft tree needs one parent per node: {len(parents)} parents for {n} nodes")
        _require(len(q) in (0, n), f"q has {len(q)} rows for {n} tree nodes; send one per node or none")
        depth: list[int] = []
        for i, p in enumerate(parents):
            _require(
                isinstance(p, int) and not isinstance(p, bool) and -1 <= p < i,
                f"node {i} has parent {p!r}; a parent must be -1 (the committed prefix) or an earlier node's index",
            )
            d = 1 if p < 0 else depth[p] + 1
            _require(d <= max_depth, f"node {i} is at depth {d}; this service verifies trees at most {max_depth} deep")
            depth.append(d)
        cap = min(max_q_width, vocab_size)
        for i, (ids, probs) in enumerate(q):
            _require(
                len(ids) == len(probs) and len(ids) > 0,
                f"q of tree node {i}: need equal, non-zero numbers of token_ids and probs",
            )
            check_row_width(i, len(ids), cap)
        tokens = checked_tokens(token_ids, vocab_size)
        if not q:
            return DraftTree(tuple(tokens), tuple(parents))
        width = max(len(ids) for ids, _ in q)
        q_ids = torch.zeros(n, width, dtype=torch.int64)
        q_probs = torch.zeros(n, width, dtype=torch.float32)
        for i, (ids, probs) in enumerate(q):
            q_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
            q_probs[i, : len(ids)] = torch.as_tensor(probs, dtype=torch.float32)
        tree = DraftTree(tuple(tokens), tuple(parents), q_ids, q_probs)
        tree.check_q(vocab_size)
        return tree

    @staticmethod
    def chain(token_ids: Sequence[int], q_ids: Tensor | None = None, q_probs: Tensor | None = None) -> DraftTree:
        """K chained nodes (node i's parent is i - 1), e.g. from a chain Proposal's fields; not validated."""
        return DraftTree(tuple(int(t) for t in token_ids), tuple(range(-1, len(token_ids) - 1)), q_ids, q_probs)

    def check_q(self, vocab_size: int) -> None:
        """Each node's q: ids in the vocabulary, finite non-negative mass, its own token in its support."""
        if self.q_ids is None or self.q_probs is None:
            _require(self.q_ids is None and self.q_probs is None, "a tree's q needs both ids and probs, or neither")
            return
        n = len(self)
        _require(
            self.q_ids.dim() == 2 and self.q_ids.shape[0] == n and self.q_probs.shape == self.q_ids.shape,
            f"tree q ids and probs must both be [N={n}, W], got {tuple(self.q_ids.shape)}, {tuple(self.q_probs.shape)}",
        )
        ids, probs = self.q_ids, self.q_probs
        bad_id = ((ids < 0) | (ids >= vocab_size)).any(-1)
        bad_mass = ~(probs.isfinite().all(-1) & (probs >= 0).all(-1) & (probs.sum(-1) > 0))
        tok = torch.tensor(self.token_ids, dtype=torch.int64)
        unsupported = ~((ids == tok[:, None]) & (probs > 0)).any(-1)
        for bad, what in (
            (bad_id, f"names a token id outside the vocabulary [0, {vocab_size})"),
            (bad_mass, "has probabilities that are not finite, >= 0 and not all 0"),
            (unsupported, "gives its own token probability 0"),
        ):
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise InvalidArgument(f"q of tree node {i} (token {self.token_ids[i]}) {what}")

    # ---- structure --------------------------------------------------------

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """[N] depth per node (1 for a child of the committed prefix)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        """Levels of the tree (0 when empty)."""
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N + 1] children per node in node order; entry 0 is the committed prefix's (node i is entry i + 1)."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def is_chain(self) -> bool:
        """Every parent is the previous node."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the committed prefix down to `node`, root first."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices, root first), leaves in node order."""
        return [self.path_to(i) for i in range(len(self)) if not self.children[i + 1]]

    def is_path(self, nodes: Sequence[int]) -> bool:
        """Do `nodes` go down from the committed prefix, each the child of the one before?"""
        prev = -1
        for node in nodes:
            if not (isinstance(node, int) and 0 <= node < len(self) and self.parents[node] == prev):
                return False
            prev = node
        return True

    def first_path(self) -> list[int]:
        """Node indices from the prefix down each node's first child (drafters put their likeliest child
        first: the model drafter's greedy chain, the suffix drafter's best match); [] when empty."""
        out: list[int] = []
        kids = self.children[0]
        while kids:
            out.append(kids[0])
            kids = self.children[kids[0] + 1]
        return out

    def subtree(self, root: int, max_nodes: int, max_depth: int) -> DraftTree:
        """The tree under node `root`, re-rooted at the prefix that ends with root's token: root's
        children become the prefix's, each kept node keeps its q row (as arrays or as it came from the
        wire). The first `max_nodes` of them in node order within `max_depth` levels (a prefix of a
        topological order within a depth keeps every kept node's parent)."""
        index = {root: -1}  # old node -> new index (root: the prefix)
        base = self.depths[root]
        kept: list[int] = []
        for i in range(root + 1, len(self)):
            p = self.parents[i]
            if p in index and len(kept) < max_nodes and self.depths[i] - base <= max_depth:
                index[i] = len(kept)
                kept.append(i)
        q_ids = q_probs = None
        if self.q_ids is not None and self.q_probs is not None:  # greedy trees have none: no index tensor
            rows = torch.tensor(kept, dtype=torch.int64)
            q_ids, q_probs = self.q_ids[rows], self.q_probs[rows]
        return DraftTree(
            tuple(self.token_ids[i] for i in kept),
            tuple(index[self.parents[i]] for i in kept),
            q_ids,
            q_probs,
            None if self.wire_q is None else tuple(self.wire_q[i] for i in kept),
        )

    def ancestor_mask(self, device: torch.device | str | None = None) -> Tensor:
        """[N, N] bool: [i, j] iff node j is node i or one of its ancestors (what node i attends to)."""
        mask = self._ancestors
        return mask.to(device) if device is not None else mask

    @cached_property
    def _ancestors(self) -> Tensor:
        # Level by level (one op per depth, not per node): a node's row is its parent's plus itself.
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        depths = torch.tensor(self.depths, dtype=torch.int64)
        parents = torch.tensor(self.parents, dtype=torch.int64)
        for d in range(2, self.depth + 1):
            level = (depths == d).nonzero().flatten()
            mask[level] |= mask[parents[level]]
        return mask


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """B trees padded to N nodes, for the batched verifier. Node indices are the trees' own.

    `real` marks the nodes that exist; a padded slot is never anyone's child.
    Build it with `of` (from DraftTrees) or directly from tensors (a drafter
    that grows B trees in lockstep), then `validated(V)`.
    """

    token_ids: Tensor  # [B, N] int64 (padding: 0)
    parents: Tensor  # [B, N] int64 -1 or an earlier node (padding: any)
    real: Tensor  # [B, N] bool
    q_ids: Tensor | None = None  # [B, N, W] int64
    q_probs: Tensor | None = None  # [B, N, W] float32 wire values (padding: 0); None: one-hot everywhere

    @staticmethod
    def of(trees: Sequence[DraftTree], device: torch.device | str = "cpu") -> TreeBatch:
        """Pad trees to the largest; a tree without q gets one-hot rows when another has q."""
        B, N = len(trees), max((len(t) for t in trees), default=0)
        tokens = torch.zeros(B, N, dtype=torch.int64)
        parents = torch.full((B, N), -1, dtype=torch.int64)
        real = torch.zeros(B, N, dtype=torch.bool)
        with_q = any(t.q_ids is not None for t in trees)
        W = max((t.q_ids.shape[1] for t in trees if t.q_ids is not None), default=1)
        q_ids = torch.zeros(B, N, W, dtype=torch.int64) if with_q else None
        q_probs = torch.zeros(B, N, W, dtype=torch.float32) if with_q else None
        for b, t in enumerate(trees):
            n = len(t)
            tokens[b, :n] = torch.tensor(t.token_ids, dtype=torch.int64)
            parents[b, :n] = torch.tensor(t.parents, dtype=torch.int64)
            real[b, :n] = True
            if q_ids is not None and q_probs is not None:
                if t.q_ids is None or t.q_probs is None:
                    q_ids[b, :n, 0], q_probs[b, :n, 0] = tokens[b, :n], 1.0
                else:
                    q_ids[b, :n, : t.q_ids.shape[1]] = t.q_ids
                    q_probs[b, :n, : t.q_probs.shape[1]] = t.q_probs
        dev = torch.device(device)
        return TreeBatch(
            tokens.to(dev),
            parents.to(dev),
            real.to(dev),
            None if q_ids is None else q_ids.to(dev),
            None if q_probs is None else q_probs.to(dev),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.token_ids.shape[0], self.token_ids.shape[1])

    def validated(self, vocab_size: int) -> TreeBatch:
        """Return self, or raise InvalidArgument: shapes, parents before children, ids in range, q usable."""
        _require(self.token_ids.dim() == 2, f"tree token_ids must be [B, N], got {tuple(self.token_ids.shape)}")
        B, N = self.shape
        _require(
            self.parents.shape == (B, N) and self.real.shape == (B, N),
            f"tree parents and real must be [B, N]=[{B}, {N}], got {tuple(self.parents.shape)}, "
            f"{tuple(self.real.shape)}",
        )
        idx = torch.arange(N, device=self.parents.device)
        par = self.parents
        ok_parent = (par >= -1) & (par < idx)
        _require(bool((ok_parent | ~self.real).all()), "a tree node's parent must be -1 or an earlier node")
        parent_real = self.real.gather(1, par.clamp(min=0)) | (par < 0)
        _require(bool((parent_real | ~self.real).all()), "a tree node's parent must be a real node")
        tok = self.token_ids
        _require(
            bool((((tok >= 0) & (tok < vocab_size)) | ~self.real).all()), f"tree token ids must be in [0, {vocab_size})"
        )
        if self.q_ids is None or self.q_probs is None:
            _require(self.q_ids is None and self.q_probs is None, "a tree's q needs both ids and probs, or neither")
            return self
        _require(
            self.q_ids.dim() == 3 and self.q_ids.shape[:2] == (B, N) and self.q_probs.shape == self.q_ids.shape,
            f"tree q ids and probs must both be [B, N, W] with B={B}, N={N}, "
            f"got {tuple(self.q_ids.shape)} and {tuple(self.q_probs.shape)}",
        )
        r = self.real[..., None]
        _require(bool((((self.q_ids >= 0) & (self.q_ids < vocab_size)) | ~r).all()), "tree q ids must be in range")
        probs = self.q_probs.to(torch.float64)
        _require(bool(((probs >= 0) & probs.isfinite() | ~r).all()), "tree q probabilities must be finite and >= 0")
        supported = ((self.q_ids == tok[..., None]) & (probs > 0)).any(-1)
        _require(bool((supported | ~self.real).all()), "a tree node's token must be in its own q's support (q > 0)")
        return self

    # ---- structure, vectorised --------------------------------------------

    def ranks(self) -> Tensor:
        """[B, N] int64: each real node's index among its parent's real children (padding: -1)."""
        N = self.shape[1]
        idx = torch.arange(N, device=self.parents.device)
        same = (self.parents[:, :, None] == self.parents[:, None, :]) & self.real[:, None, :]  # [B, i, j]
        earlier = same & (idx[None, None, :] < idx[None, :, None])
        return torch.where(self.real, earlier.sum(-1), -1)

    def children_table(self) -> Tensor:
        """[B, N + 1, C] int64: children[b, p + 1, r] = the rank-r child of node p (-1 none); C >= 1."""
        B, N = self.shape
        rank = self.ranks()  # [B, N]
        C = max(int(rank.max()) + 1, 1) if N else 1
        table = torch.full((B, N + 2, C), -1, dtype=torch.int64, device=self.parents.device)
        # Padding writes into a spare row N + 1, dropped below.
        row = torch.where(self.real, self.parents + 1, N + 1)  # [B, N]
        col = rank.clamp(min=0)
        node = torch.arange(N, device=self.parents.device).expand(B, N)
        b = torch.arange(B, device=self.parents.device)[:, None].expand(B, N)
        table[b, row, col] = node
        return table[:, : N + 1]
