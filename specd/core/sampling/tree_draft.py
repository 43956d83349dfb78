"""The drafter's side of tree speculation: drawing a node's children the way the verifier's rule needs.

specd.core.sampling.tree_rejection is exact when every child was drawn from
exactly the q it records, given everything drawn before it, with coins
independent of the target's (its docstring has the proof). The helpers here
draw k children of one node **sequentially without replacement** (Yang et
al. 2024; Jeon et al. 2024): child i from the sparse q with the tokens of
children 0..i-1 removed and renormalised, and each child records that
remainder as its q. With ``replacement=True`` every child is drawn from the
full q (SpecInfer's i.i.d. children), also exact, but repeats a token now
and then, which the verifier then rejects for sure.

Coins: the draw of a child uses Role.DRAFT at coin slot s of its token
position (specd.core.sampling.tree.coin_positions), s unique among the draws
at that position in the round; `TreeBuilder` counts slots per depth, so the
first draw at every depth uses slot 0, the chain drafter's coin
(specd.core.sampling.sampler.draft_token): a one-child-per-node tree is the
chain, token for token.

The numbers are the wire's: removing a token zeroes its wire value, the rest
stay as sent, and q = wire / wire.sum() in float64 on both sides
(:func:`specd.core.sampling.sampler.sample_sparse`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from specd.core.errors import InvalidArgument
from specd.core.sampling.proposal import DEFAULT_MAX_Q_WIDTH, QRow
from specd.core.sampling.sampler import Role, host_coins
from specd.core.sampling.tree import COIN_STRIDE, DEFAULT_MAX_TREE_DEPTH, DEFAULT_MAX_TREE_NODES, DraftTree

__all__ = ["TreeBuilder", "draw_children"]


def draw_children(
    ids: Tensor,
    wire: Tensor,
    k: int,
    seeds: Tensor,
    positions: Tensor,
    first_slot: Tensor | int = 0,
    *,
    replacement: bool = False,
    later: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Draw k children of one node in each of B rows.

    ids, wire:  [B, W] the node's sparse q (int64 ids, float32 wire values or integer weights)
    seeds:      [B] int64; positions: [B] int64 the children's token position
    first_slot: coin slot of child 0 (child i uses first_slot + i)
    later:      [B, W] another q on the same ids for children 1.. (child 0 from wire), the tokens
                drawn before each removed from it too; None: every child from wire
    returns:    (tokens [B, k] int64, q [B, k, W] float32: the wire each child was drawn from,
                 drawn [B, k] bool: False once a row's q has no token left (its later slots are not children))
    """
    if not (isinstance(k, int) and k >= 0):
        raise InvalidArgument(f"k must be an int >= 0, got {k!r}")
    assert ids.shape == wire.shape and ids.dim() == 2, f"ids and wire must be [B, W], got {tuple(ids.shape)}"
    assert seeds.shape == positions.shape == ids.shape[:1]
    B, W = ids.shape
    # On the host in numpy: a few [B, W] rows, k draws each; the arithmetic is sample_sparse's
    # (float32 remainder, normalised and summed in float64, inverse CDF with searchsorted's rule).
    ids_np = ids.detach().to("cpu", torch.int64).numpy()
    w = wire.detach().to("cpu", torch.float32).numpy().copy()  # [B, W] the remainder
    rest = None if later is None else later.detach().to("cpu", torch.float32).numpy().copy()  # [B, W] children 1..
    slots = np.broadcast_to(torch.as_tensor(first_slot, dtype=torch.int64).numpy(), (B,))[:, None] + np.arange(k)
    pos = positions.detach().to("cpu", torch.int64).numpy()[:, None] + slots * COIN_STRIDE  # [B, k]
    u = host_coins(seeds.detach().to("cpu", torch.int64).numpy(), pos, Role.DRAFT)  # [B, k] every coin at once
    tokens = np.zeros((B, k), dtype=np.int64)
    qs = np.zeros((B, k, W), dtype=np.float32)
    drawn = np.zeros((B, k), dtype=bool)
    left = np.ones(B, dtype=bool)
    rows = np.arange(B)
    for i in range(k):
        if i == 1 and rest is not None:
            w = rest
        left &= w.sum(-1) > 0
        if not left.any():
            break
        src = np.where(left[:, None], w, np.float32(1.0)).astype(np.float64)  # exhausted rows: a placeholder
        q = src / src.sum(-1, keepdims=True)
        cdf = np.cumsum(q, -1)  # [B, W]
        slot = (cdf <= (u[:, i] * cdf[:, -1])[:, None]).sum(-1)  # searchsorted(right=True)
        over = slot >= W  # u * total rounded up to total: the last slot with weight
        if over.any():
            slot = np.where(over, W - 1 - np.argmax((q > 0)[:, ::-1], -1), slot)
        tok = ids_np[rows, slot]
        tokens[:, i], qs[:, i], drawn[:, i] = tok, np.where(left[:, None], w, np.float32(0.0)), left
        if not replacement:
            w = w * (ids_np != tok[:, None])  # every slot of that token (ids may repeat)
            if rest is not None and i == 0:
                rest = rest * (ids_np != tok[:, None])
    dev = ids.device
    return torch.from_numpy(tokens).to(dev), torch.from_numpy(qs).to(dev), torch.from_numpy(drawn).to(dev)


class TreeBuilder:
    """Grow one draft tree node by node (a drafter's expansion loop), with the right coins and q rows.

    `draw_level` samples children of nodes from their q without replacement; `add` puts
    a node the drafter chose without sampling (n-gram, suffix: q one-hot at it,
    exact as any candidate independent of the target's coins). `build` validates.
    """

    def __init__(self, seed: int, start_position: int) -> None:
        self.seed = seed
        self.start_position = start_position  # the committed length: position of a depth-1 node
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self._q: list[QRow | None] = []  # per node: (ids, wire) it was drawn from; None: one-hot
        self._depths: list[int] = []
        self._slots: dict[int, int] = {}  # depth -> coin slots used there

    def __len__(self) -> int:
        return len(self.token_ids)

    def depth_of(self, node: int) -> int:
        """Depth of node (0 for -1, the committed prefix)."""
        return 0 if node < 0 else self._depths[node]

    def add(self, parent: int, token: int, q: QRow | None = None) -> int:
        """Append one node under `parent` (-1: the prefix); returns its index."""
        if not -1 <= parent < len(self):
            raise InvalidArgument(f"parent {parent} is not -1 or an existing node")
        self.token_ids.append(int(token))
        self.parents.append(parent)
        self._q.append(q)
        self._depths.append(self.depth_of(parent) + 1)
        return len(self) - 1

    def draw_level(
        self,
        parents: Sequence[int],
        ids: Tensor,
        wire: Tensor,
        counts: Sequence[int],
        later: Tensor | None = None,
    ) -> list[list[int]]:
        """counts[r] children of each parent r (all of one depth) from its q without replacement
        (ids [P, W], wire [P, W]; children after the first from `later` [P, W] if given, see
        draw_children), in ONE batched draw. Parent r's draws take coin slots after the counts of
        parents 0..r-1 (fixed before any value is drawn, so unique whatever is drawn); returns each
        parent's new nodes."""
        if not parents:
            return []
        depths = {self.depth_of(p) for p in parents}
        if len(depths) != 1:
            raise InvalidArgument(f"draw_level needs parents of one depth, got depths {sorted(depths)}")
        depth = depths.pop() + 1
        slot = self._slots.get(depth, 0)
        P, k = len(parents), max(counts)
        firsts = torch.tensor([slot + sum(counts[:r]) for r in range(P)], dtype=torch.int64)
        seeds = torch.full((P,), self.seed, dtype=torch.int64)
        pos = torch.full((P,), self.start_position + depth - 1, dtype=torch.int64)
        tokens, qs, drawn = draw_children(ids, wire, k, seeds, pos, firsts, later=later)
        self._slots[depth] = slot + sum(counts)
        out: list[list[int]] = []
        tok, got = tokens.tolist(), drawn.tolist()
        for r, p in enumerate(parents):
            kept = [i for i in range(counts[r]) if got[r][i]]
            out.append([self.add(p, tok[r][i], (ids[r].cpu(), qs[r, i].cpu())) for i in kept])
        return out

    def build(
        self,
        vocab_size: int,
        *,
        max_nodes: int = DEFAULT_MAX_TREE_NODES,
        max_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_q_width: int = DEFAULT_MAX_Q_WIDTH,
        checked: bool = True,
    ) -> DraftTree:
        """The tree, validated as one from the wire would be (q one-hot where none was recorded).

        checked=False: a drafter's own draws (`draw_level`: every row a sparse q, every token drawn
        from its row), assembled into the same tensors without the wire's per-row copies and checks
        (`DraftTree.check_q` alone was 0.3 ms of a 16-node, two-level tree round at T = 0.7,
        V = 32,000, emulated, in-process); the target checks the tree as it arrives anyway."""
        q: Sequence[QRow] = []
        if any(row is not None for row in self._q):
            q = [row if row is not None else ([t], [1.0]) for row, t in zip(self._q, self.token_ids)]
        if q and not checked:
            q_ids = pad_sequence([torch.as_tensor(i, dtype=torch.int64) for i, _ in q], batch_first=True)
            q_probs = pad_sequence([torch.as_tensor(w, dtype=torch.float32) for _, w in q], batch_first=True)
            return DraftTree(tuple(self.token_ids), tuple(self.parents), q_ids, q_probs)
        return DraftTree.from_wire(
            self.token_ids,
            self.parents,
            q,
            vocab_size,
            max_nodes=max_nodes,
            max_depth=max_depth,
            max_q_width=max_q_width,
        )
