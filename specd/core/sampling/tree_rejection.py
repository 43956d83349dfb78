"""The target's verdict on a draft tree: recursive rejection sampling over siblings, exactly.

Words as in specd.core.sampling.rejection (accepted, recovered, bonus) and
specd.core.sampling.tree (depth, rank, coin slots).

**The rule (T > 0): recursive rejection sampling (RRS).** Start at the
committed prefix with r = p, the target's processed distribution there. Try
the current node's children c_1, c_2, ... in node order; child c_i carries
its token x_i and q_i, the distribution it was drawn from:

- accept x_i iff u_i < min(1, r(x_i) / q_i(x_i)); then descend: the current
  node becomes c_i and r = p after it;
- else r <- normalise(max(0, r - q_i)) over the full vocabulary and try the
  next child.

When the children run out, the round ends: after at least one rejection the
**recovered** token is drawn from r; at a node without children (a leaf, or
the prefix of an empty tree) the **bonus** token is drawn from p there. The
verdict is the accepted path (node indices) and that one more token. This is
the multi-candidate rule of SpecInfer (Miao et al. 2024, "multi-step
speculative sampling", children drawn i.i.d. from one q), which Yang et al.
2024 ("Multi-candidate speculative decoding") and Jeon et al. 2024
("Recursive speculative decoding") use with children drawn **without
replacement**: child i from q renormalised over the tokens not drawn yet.
specd's drafter helper (specd.core.sampling.tree_draft) draws that way, and
each child records the remainder it was drawn from as its q.

**Why the output has exactly the target's distribution.** One step: given
anything that happened before it, let x ~ Q be drawn independently of the
target's coins, accepted with probability min(1, r(x)/Q(x)), and on
rejection let the round continue with something that emits y ~ res =
normalise(max(0, r - Q)) whatever x was. Then
P(y) = min(Q, r)(y) + (sum_z max(0, r - Q)(z)) res(y) = min(Q, r)(y) + max(0, r - Q)(y) = r(y)
(Leviathan et al. 2023, Thm 1). Induction over the siblings, last first:
with no child left the round emits y ~ r directly; a child's step emits r
if what follows its rejection emits its residual, which the hypothesis
gives, because the next child's residual target is exactly that residual
and the next child is drawn from its recorded q given everything before it
(the rule never needs q_{i+1} to be q_i without x_i: i.i.d. children,
children without replacement and deterministic (one-hot) candidates are all
covered; without replacement, r(x_i) = 0 after x_i's rejection, so no
rejected token is proposed twice). So the first emitted token after the
prefix follows p; once x is accepted the same argument runs from the child
with p after it, so by induction on depth every emitted token follows the
target's conditional given the tokens before it: the joint distribution is
target-only sampling's. The verifier uses each child's *recorded* q, so the
drafter's one duty is the chain's: sample each child from exactly the q it
sends, with coins independent of the target's, and keep every token it draws
(dropping a drawn child because of its own value biases it). How many
children a node gets may depend on anything drawn before them.

**Greedy (T = 0)**: p is one-hot at the argmax. :func:`tree_greedy_verdict`
accepts the deepest path whose every node is the argmax after its parent
(ties: the lowest node index) and emits the argmax after it; its tokens are
target-only greedy decoding's whichever path is taken, since every matching
path spells the same greedy continuation.

**Coins** (:func:`specd.core.sampling.tree.coin_positions`): the accept coin
of the rank-k child at depth d is Role.ACCEPT at slot k of position
start + d - 1; the recovered coin is Role.RECOVER at slot 0 of the position
of the emitted token, and a bonus token is the race of
specd.core.sampling.bonus_race at that position. Along the one path the
target walks, each coin is used once, and a chain's coins are the chain's:
a chain tree gets :func:`specd.core.sampling.rejection.rejection_sample`'s
verdict, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling.bonus_race import race_draw, race_draw_rows
from specd.core.sampling.greedy import greedy_tokens
from specd.core.sampling.rejection import ZERO_RESIDUAL
from specd.core.sampling.sampler import Role, coins, host_coins, sample_from_probs
from specd.core.sampling.tree import COIN_STRIDE, DraftTree, TreeBatch, coin_positions

__all__ = [
    "TreeVerdict",
    "TreeVerdicts",
    "next_residual",
    "tree_greedy_verdict",
    "tree_rejection_row",
    "tree_rejection_sample",
]


@dataclass(frozen=True)
class TreeVerdict:
    """One tree's verdict: the accepted path and the one more token."""

    accepted: tuple[int, ...]  # node indices, root first (each the child of the one before)
    next_token: int  # recovered at the last accepted node's children, else the bonus token after it
    is_bonus: bool  # the last accepted node (or the prefix) has no children: next_token drawn from p there

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


@dataclass(frozen=True)
class TreeVerdicts:
    """The batched verdict, per row."""

    accepted: Tensor  # [B, D] int64 node indices of the accepted path, root first; -1 past its end
    num_accepted: Tensor  # [B] int64
    next_token: Tensor  # [B] int64
    is_bonus: Tensor  # [B] bool

    def row(self, b: int) -> TreeVerdict:
        n = int(self.num_accepted[b])
        path = tuple(int(i) for i in self.accepted[b, :n].tolist())
        return TreeVerdict(path, int(self.next_token[b]), bool(self.is_bonus[b]))


def next_residual(weights: Tensor, total: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """After a rejection: r <- max(0, r - q), unnormalised, with its mass.

    weights: [R, V] float64 r up to a factor; total: [R] its mass (r = weights / total); q: [R, V] dense q.
    returns: (weights, total) of the residual. Where it has no mass (p == q up to rounding;
             a rejection there has probability ~0) r stays as it was, as rejection.py samples from p.
    """
    w = torch.clamp(weights / total[:, None] - q, min=0.0)  # [R, V]
    z = w.sum(-1)  # [R]
    keep = z > ZERO_RESIDUAL
    return torch.where(keep[:, None], w, weights), torch.where(keep, z, total)


def tree_rejection_sample(
    target_probs: Tensor,
    trees: TreeBatch,
    seeds: Tensor,
    start_positions: Tensor,
) -> TreeVerdicts:
    """Verify B draft trees against the target's p (see the module docstring).

    The rule over a dense batch: the chi-square tests run it over 20,000 rows in lockstep, and
    the verifier's per-tree host walk (`tree_rejection_row`) must give its verdicts, coin for coin.

    target_probs:    [B, N+1, V] float p: row 0 after the committed prefix, row 1+i after node i
                     (rows of padded nodes are never read)
    trees:           B trees padded to N nodes (validated here against V)
    seeds:           [B] int64 request seeds
    start_positions: [B] int64 absolute position of a depth-1 node (the committed length)
    """
    if target_probs.dim() != 3:
        raise InvalidArgument(f"target_probs must be [B, N+1, V], got {tuple(target_probs.shape)}")
    B, N1, V = target_probs.shape
    if trees.shape != (B, N1 - 1):
        raise InvalidArgument(f"trees must be [B, N]=[{B}, {N1 - 1}] to match target_probs, got {trees.shape}")
    if seeds.shape != (B,) or start_positions.shape != (B,):
        raise InvalidArgument(f"seeds and start_positions must be [B]=[{B}]")
    trees.validated(V)
    dev = target_probs.device
    N = N1 - 1
    rows = torch.arange(B, device=dev)
    kids = trees.children_table().to(dev)  # [B, N+1, C]
    tokens = trees.token_ids.to(dev)  # [B, N]
    if trees.q_ids is None or trees.q_probs is None:  # one-hot q at every node
        q_ids, q_w = tokens[..., None], torch.ones(B, N, 1, dtype=torch.float64, device=dev)
    else:
        q_ids, q_w = trees.q_ids.to(dev), trees.q_probs.to(device=dev, dtype=torch.float64)
    q_w = q_w / torch.where(q_w.sum(-1, keepdim=True) > 0, q_w.sum(-1, keepdim=True), 1.0)  # [B, N, W]
    start = start_positions.to(dev, torch.int64)

    cur = torch.full((B,), -1, dtype=torch.int64, device=dev)  # the last accepted node (-1: the prefix)
    depth = torch.zeros(B, dtype=torch.int64, device=dev)  # accepted so far
    rank = torch.zeros(B, dtype=torch.int64, device=dev)  # next child of `cur` to try
    path = torch.full((B, max(N, 1)), -1, dtype=torch.int64, device=dev)
    r_w = target_probs[:, 0].to(torch.float64)  # [B, V] r up to a factor (p itself at first)
    r_tot = torch.ones(B, dtype=torch.float64, device=dev)  # p's mass taken as 1, as rejection.py does
    active = torch.ones(B, dtype=torch.bool, device=dev)
    final_w = r_w.clone()  # [B, V] what the emitted token is drawn from
    is_bonus = torch.zeros(B, dtype=torch.bool, device=dev)

    # Each turn every active row tries one child or ends: at most N + depth + 1 turns.
    while bool(active.any()):
        child = kids[rows, cur + 1, rank.clamp(max=kids.shape[2] - 1)]  # [B]
        child = torch.where(rank < kids.shape[2], child, -1)
        ending = active & (child < 0)
        final_w = torch.where(ending[:, None], r_w, final_w)
        is_bonus = is_bonus | (ending & (rank == 0))
        active = active & ~ending
        if not bool(active.any()):
            break
        c = child.clamp(min=0)
        x = tokens[rows, c]  # [B]
        q = torch.zeros(B, V, dtype=torch.float64, device=dev).scatter_add_(-1, q_ids[rows, c], q_w[rows, c])
        q_x = q.gather(-1, x[:, None]).squeeze(-1)  # [B]
        ratio = r_w.gather(-1, x[:, None]).squeeze(-1) / (r_tot * torch.where(q_x > 0, q_x, 1.0))
        pos = coin_positions(start + depth, rank)
        u = coins(seeds, pos[:, None], Role.ACCEPT)[:, 0].to(dev)
        acc = active & (u < torch.clamp(ratio, max=1.0))
        rej = active & ~acc
        # rejected: r <- residual, try the next sibling
        w2, t2 = next_residual(r_w, r_tot, q)
        # accepted: descend, r <- p after the child
        p_child = target_probs[rows, c + 1].to(torch.float64)
        r_w = torch.where(acc[:, None], p_child, torch.where(rej[:, None], w2, r_w))
        r_tot = torch.where(acc, 1.0, torch.where(rej, t2, r_tot))
        path[rows[acc], depth[acc]] = child[acc]
        cur = torch.where(acc, child, cur)
        depth = depth + acc.to(torch.int64)
        rank = torch.where(acc, 0, rank + rej.to(torch.int64))

    pos = (start + depth)[:, None]  # [B, 1] the emitted token's position
    next_token = torch.zeros(B, dtype=torch.int64, device=dev)
    rec = torch.nonzero(~is_bonus).flatten()  # rows that recover: the residual's inverse CDF
    if rec.numel():
        u_rec = coins(seeds[rec.to(seeds.device)], pos[rec], Role.RECOVER)[:, 0].to(dev)
        next_token[rec] = sample_from_probs(final_w[rec], u_rec)
    bonus = torch.nonzero(is_bonus).flatten().tolist()
    if bonus:  # the bonus: the race over p (bonus_race)
        drawn = race_draw_rows([final_w[b] for b in bonus], seeds[bonus].tolist(), pos[bonus, 0].tolist())
        next_token[bonus] = torch.tensor(drawn, dtype=torch.int64, device=dev)
    return TreeVerdicts(path[:, :N], depth, next_token, is_bonus)


def tree_rejection_row(read_p: Callable[[int], np.ndarray], tree: DraftTree, seed: int, start: int) -> TreeVerdict:
    """`tree_rejection_sample` for one tree, on the host, reading p only where the walk needs it.

    read_p(i): p after the prefix (i = 0) or after node i - 1, as a float64 [V] array; it is called
               for the prefix and for each accepted node only (depth + 1 rows of the N + 1), and
               may raise for a row that cannot be sampled
    seed:      the request's seed; start: absolute position of a depth-1 node (the committed length)

    The same rule and coins as the batched function, with r kept up to a scale: a rejection
    changes r only on the child's q support (elsewhere it is rescaled), so a sibling costs O(W)
    plus one copy of p's row at the first rejection at a node, not several passes over V.
    """
    kids, tokens = tree.children, tree.token_ids
    depth_max = tree.depth
    width = max((len(k) for k in kids), default=1) or 1
    # Every accept coin the walk could use: depth d (accepted so far) x rank k, one hash call.
    pos = np.array([[start + d + k * COIN_STRIDE for d in range(depth_max + 1) for k in range(width)]], np.int64)
    u_acc = host_coins(np.array([seed], np.int64), pos, Role.ACCEPT)[0].reshape(depth_max + 1, width)
    q_ids = tree.q_ids.numpy() if tree.q_ids is not None else None  # [N, W]
    q_w = tree.q_probs.numpy() if tree.q_probs is not None else None  # [N, W] wire values

    path: list[int] = []
    cur, rank = -1, 0
    base = read_p(0)  # [V] float64: r = scale * base / total; rewritten in place after a rejection
    copied = False  # base is read_p's array until the first rejection at a node copies it
    scale, total, base_sum = 1.0, 1.0, 0.0  # p's mass taken as 1, as the batched rule does
    while rank < len(kids[cur + 1]):
        c = kids[cur + 1][rank]
        x = tokens[c]
        t_ids: np.ndarray
        t_q: np.ndarray
        if q_ids is None or q_w is None:
            t_ids, t_q = np.array([x], np.int64), np.ones(1)
        else:  # the child's q, normalised as the batched rule does; repeated ids summed
            w = q_w[c].astype(np.float64)
            w = w / w.sum()
            t_ids, inverse = np.unique(q_ids[c][w > 0], return_inverse=True)
            t_q = np.bincount(inverse, weights=w[w > 0], minlength=len(t_ids))
        hit = t_ids == x
        q_x = float(t_q[hit].sum())
        r_x = scale * float(base[x])
        if u_acc[len(path), rank] < min(1.0, r_x / (total * (q_x if q_x > 0 else 1.0))):
            path.append(c)
            cur, rank = c, 0
            base, copied, scale, total = read_p(c + 1), False, 1.0, 1.0
            continue
        # Rejected: r <- max(0, r - q) (unnormalised, its mass z), kept as it is where z ~ 0.
        if not copied:
            base, copied, base_sum = base.copy(), True, float(base.sum())
        new_scale = scale / total
        old = base[t_ids]
        kept = np.maximum(0.0, scale * old / total - t_q) / new_scale
        removed = float((old - kept).sum())
        z = new_scale * (base_sum - removed)
        if z > ZERO_RESIDUAL:
            base[t_ids] = kept
            scale, total, base_sum = new_scale, z, base_sum - removed
        rank += 1
    is_bonus = rank == 0
    if is_bonus:  # p after the path, as read: the race over it (bonus_race)
        return TreeVerdict(tuple(path), race_draw(base, None, seed, start + len(path)), True)
    final = torch.from_numpy(base)  # [V] r up to its factor
    emit = np.array([[start + len(path)]], np.int64)
    u = host_coins(np.array([seed], np.int64), emit, Role.RECOVER)[0]
    token = int(sample_from_probs(final[None], torch.from_numpy(u))[0])
    return TreeVerdict(tuple(path), token, False)


def tree_greedy_verdict(logits: Tensor, tree: DraftTree) -> TreeVerdict | None:
    """One tree's greedy verdict from its logits alone (temperature 0).

    logits:  [N+1, V]: row 0 after the committed prefix, row 1+i after node i
    returns: the deepest path of argmax tokens (ties: lowest node index) and the argmax after
             it; None if the logits cannot be sampled (NaN, +inf, or no finite value in a row)
    """
    n = len(tree)
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise InvalidArgument(f"logits must be [N+1={n + 1}, V] for a tree of {n} nodes, got {tuple(logits.shape)}")
    best, bad = greedy_tokens(logits)  # [N+1] each
    if bool(bad.any()):
        return None
    argmax = best.tolist()
    # deep[i]: the longest argmax path starting at node i (0 if node i is not its parent's argmax).
    deep = [0] * n
    for i in range(n - 1, -1, -1):  # children after parents: each node's children are done first
        if tree.token_ids[i] == argmax[tree.parents[i] + 1]:
            deep[i] = 1 + max((deep[c] for c in tree.children[i + 1]), default=0)
    path: list[int] = []
    node = -1
    while True:
        # max() keeps the first of equals: the lowest node index among the deepest
        nxt = max(tree.children[node + 1], key=lambda c: deep[c], default=-1)
        if nxt < 0 or deep[nxt] == 0:
            break
        path.append(nxt)
        node = nxt
    return TreeVerdict(tuple(path), argmax[node + 1], not tree.children[node + 1])
