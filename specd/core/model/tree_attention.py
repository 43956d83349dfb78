"""The layout of a tree-verify pass: input ids, position ids and the 4D tree attention mask.

Session b has `start_b` positions cached (its past) and runs its uncached
committed tokens (the *tail*, m_b >= 1 of them, ending with its last token,
whose logits predict a depth-1 node) followed by the N_b nodes of its draft
tree. The batch's past is L = max start_b, each session's past right-aligned
at L (left padding), and its new rows padded to S = max (m_b + N_b). Query
row r of session b sees, in key columns [0, L + S):

- its own past (columns L - start_b .. L - 1): every real row;
- tail row r < m_b: tail rows 0..r (causal);
- node row m_b + i: the whole tail, and node j iff j is i or an ancestor of i
  (DraftTree.ancestor_mask): never a sibling or a cousin;
- a padding row: itself only (a row must see something, or softmax is 0/0).

Positions: tail row r is at start_b + r, node i at n_b + depth_i - 1 with
n_b = start_b + m_b the committed length: a node sits where it would sit in
its own chain, so each path's logits are the chain's (RoPE and learned
positions alike). The mask is additive float (0: attend, finfo.min: hidden),
which both eager attention (it adds the mask to the scores) and SDPA take;
transformers 5.x passes a 4D mask through unchanged (masking_utils'
"already prepared or custom" early exit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specd.core.sampling.tree import DraftTree

__all__ = ["TreeLayout", "tree_layout"]


@dataclass(frozen=True)
class TreeLayout:
    input_ids: Tensor  # [B, S] int64 (padding: 0)
    position_ids: Tensor  # [B, S] int64
    mask: Tensor  # [B, 1, S, L + S] additive, in the model's dtype
    rows: Tensor  # [B, S] bool: the rows whose logits come back (last tail row, then every node)
    past: int  # L
    tails: list[int]  # m_b
    nodes: list[int]  # N_b


def tree_layout(
    starts: Sequence[int],
    tails: Sequence[Sequence[int]],
    trees: Sequence[DraftTree],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_position: int,
) -> TreeLayout:
    """Build one pass's layout (see the module docstring); padded positions are clamped to max_position."""
    assert len(starts) == len(tails) == len(trees) and all(len(t) >= 1 for t in tails)
    B = len(starts)
    ms = [len(t) for t in tails]
    ns = [len(t) for t in trees]
    L = max(starts)
    S = max(m + n for m, n in zip(ms, ns))
    input_ids = torch.zeros(B, S, dtype=torch.int64)
    positions = torch.zeros(B, S, dtype=torch.int64)
    allowed = torch.zeros(B, S, L + S, dtype=torch.bool)
    rows = torch.zeros(B, S, dtype=torch.bool)
    for b, (start, tail, tree, m, n) in enumerate(zip(starts, tails, trees, ms, ns)):
        committed = start + m
        input_ids[b, :m] = torch.tensor(list(tail), dtype=torch.int64)
        input_ids[b, m : m + n] = torch.tensor(tree.token_ids, dtype=torch.int64)
        positions[b, :m] = torch.arange(start, committed)
        positions[b, m : m + n] = committed - 1 + torch.tensor(tree.depths, dtype=torch.int64)
        positions[b, m + n :] = torch.arange(committed, committed + S - m - n)  # padding: any, clamped
        allowed[b, : m + n, L - start : L] = True  # the past
        allowed[b, :m, L : L + m] = torch.ones(m, m, dtype=torch.bool).tril()  # the tail, causal
        allowed[b, m : m + n, L : L + m] = True  # nodes see the whole tail
        allowed[b, m : m + n, L + m : L + m + n] = tree.ancestor_mask()  # ... and their ancestors
        pad = torch.arange(m + n, S)
        allowed[b, pad, L + pad] = True  # a padding row sees itself
        rows[b, m - 1 : m + n] = True
    hidden = torch.finfo(dtype).min
    mask = torch.zeros(B, 1, S, L + S, dtype=dtype).masked_fill_(~allowed[:, None], hidden)
    return TreeLayout(
        input_ids.to(device),
        positions.clamp_(max=max_position).to(device),
        mask.to(device),
        rows.to(device),
        L,
        ms,
        ns,
    )
