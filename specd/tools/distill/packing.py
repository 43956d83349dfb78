"""Stage 2: the draft's vocabulary (reduced head) and the training tensors, batched on demand."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def choose_vocab(records: Sequence[dict], vocab_size: int, n: int, always: Sequence[int] = ()) -> Tensor:
    """The n target token ids carrying the most teacher probability mass (plus `always`), ascending."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        p = r["logprobs"].float().exp().double()  # [R, k]
        mass.index_add_(0, r["ids"].reshape(-1).long(), p.reshape(-1))
        mass.index_add_(0, r["tokens"].long(), torch.full((len(r["tokens"]),), 0.1, dtype=torch.float64))
    for t in always:
        mass[int(t)] = float("inf")
    n = min(n, vocab_size)
    top = torch.topk(mass, n).indices
    return torch.sort(top).values.to(torch.int64)


@dataclass
class Packed:
    """Training tensors of a list of records, padded per batch on demand."""

    tokens: list[Tensor]  # [T] int64 each
    start: list[int]
    tgt_idx: list[Tensor]  # [R, k] int64 column index in the draft head, -1 = not in it
    tgt_p: list[Tensor]  # [R, k] float32, teacher probabilities restricted to the head, renormalised
    tgt_top: list[Tensor]  # [R] int64 the teacher's argmax (target id)

    def __len__(self) -> int:
        return len(self.tokens)


def pack(records: Sequence[dict], inverse: Tensor | None) -> Packed:
    """Map teacher ids to draft head columns (inverse[target id] -> column or -1) and renormalise."""
    out = Packed([], [], [], [], [])
    for r in records:
        ids = r["ids"].long()
        p = torch.softmax(r["logprobs"].float(), dim=-1)  # the top-k, renormalised
        idx = ids if inverse is None else inverse[ids]
        p = torch.where(idx >= 0, p, 0.0)
        total = p.sum(-1, keepdim=True)
        p = torch.where(total > 0, p / total.clamp_min(1e-12), 0.0)
        out.tokens.append(r["tokens"].long())
        out.start.append(int(r["start"]))
        out.tgt_idx.append(idx)
        out.tgt_p.append(p)
        out.tgt_top.append(ids[:, 0])
    return out


def make_batch(packed: Packed, rows: Sequence[int], seq_len: int, rng: random.Random) -> dict[str, Tensor]:
    """Right-padded batch: input [B, T], teacher columns/probs [B, T, k], row mask [B, T]."""
    k = packed.tgt_idx[0].shape[1]
    pieces = []
    for i in rows:
        toks, start, nrows = packed.tokens[i], packed.start[i], packed.tgt_idx[i].shape[0]
        lo = 0
        if len(toks) > seq_len:  # a window that keeps teacher rows in it
            lo = rng.randrange(0, max(1, min(len(toks) - seq_len, start + nrows - 1)) + 1)
        hi = min(len(toks), lo + seq_len)
        pieces.append((i, lo, hi))
    width = max(hi - lo for _, lo, hi in pieces)
    B = len(pieces)
    x = torch.zeros((B, width), dtype=torch.long)
    cols = torch.full((B, width, k), -1, dtype=torch.long)
    probs = torch.zeros((B, width, k))
    top = torch.full((B, width), -1, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.bool)
    for b, (i, lo, hi) in enumerate(pieces):
        x[b, : hi - lo] = packed.tokens[i][lo:hi]
        s = packed.start[i]
        r0, r1 = max(lo, s), min(hi, s + packed.tgt_idx[i].shape[0])  # positions with a teacher row
        if r1 > r0:
            cols[b, r0 - lo : r1 - lo] = packed.tgt_idx[i][r0 - s : r1 - s]
            probs[b, r0 - lo : r1 - lo] = packed.tgt_p[i][r0 - s : r1 - s]
            top[b, r0 - lo : r1 - lo] = packed.tgt_top[i][r0 - s : r1 - s]
            mask[b, r0 - lo : r1 - lo] = True
    return {"x": x, "cols": cols, "probs": probs, "top": top, "mask": mask}
