"""The tokens a filtered row keeps (top-k, then top-p, then min-p), read off its first ranks only.

specd.core.sampling.sampler.processed_probs defines the rule: rank the row's probabilities,
most likely first (ties: the lower id first), keep ranks < top_k, renormalise them, keep a rank
while the mass strictly before it is < top_p (float64 running sum), and while it is >= min_p
times the top one. Each rule keeps a prefix of the ranking, so the kept set is the first L ranks.

Ranking the whole row is a stable sort of V values: 2.5 ms a row at V = 32,000 on this host's
CPU, 12 ms at 128,256 (one thread), for every position a sampled request verifies or drafts with
top-p or top-k. Most rows' L is a few ranks, some hundreds, so this module ranks only the first
w (one top-k of w + 1, re-sorted by id among equal values) and decides a row there when its L is
shorter and no value tied with the first rank left out sits inside it (then the first w ranks are
exactly the stable sort's): w = 32, then 256, then 4,096 for the rows still open, on rows of
8,192 tokens or more (SmolLM2-135M-Instruct's rows over the bench prompts at T = 0.7-1, top-p
0.9-0.95 keep fewer than 32 tokens 90-100% of the time). A row none decides (a flat row, a top-k
past them, ties across the cut, NaN), and every narrower row, takes the whole sort, as before.

The renormalising sum after top-k is the top-k values' sum (the row's whole sum when top-k is
off), summed in float64 and rounded to float32 once, so a row's numbers depend on its own values
only, never on its batch-mates, and both ways give it the same sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kept_mask"]

_WIDTHS = (32, 256, 4096)  # ranks read without the whole sort: first a few, then the undecided rows' more
# Where the first ranks pay: a vocabulary this wide, and a width at most a quarter of it (on narrower
# rows the sort is cheap and the selection's own steps cost more: V = 2,048, one row, 0.56 ms sorted
# against 0.69 through the first ranks; V = 8,192: 0.87 against 0.58).
_MIN_VOCAB = 8192
_MAX_SHARE = 4


def kept_mask(probs: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """[R, V] bool: the tokens each row keeps under its filters (module docstring).

    probs: [R, V] float32 probabilities; top_k: [R] int64 in [1, V] (V: off); top_p: [R] float64
    in (0, 1] (1: off); min_p: [R] float32 in [0, 1] (0: off).
    """
    R, V = probs.shape
    if V < _MIN_VOCAB:
        return _kept_by_sort(probs, top_k, top_p, min_p)
    mass = probs.sum(-1, dtype=torch.float64)  # [R] each whole row's, once for every width that reads it
    mask = torch.zeros(R, V, dtype=torch.bool, device=probs.device)
    rest = torch.arange(R, device=probs.device)  # rows not decided yet
    for w in _WIDTHS:  # ranks read; one more value tells whether a tie crosses the cut
        if (w + 1) * _MAX_SHARE > V or not len(rest):
            break
        whole = len(rest) == R  # the first width reads every row: no copy of them
        rows = (
            (probs, mass, top_k, top_p, min_p)
            if whole
            else (probs[rest], mass[rest], top_k[rest], top_p[rest], min_p[rest])
        )
        decided, part = _kept_in_first(*rows, w)
        mask[rest[decided]] = part[decided]
        rest = rest[~decided]
    if len(rest):
        mask[rest] = _kept_by_sort(probs[rest], top_k[rest], top_p[rest], min_p[rest], mass[rest])
    return mask


def _kept_in_first(
    probs: Tensor, mass: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, w: int
) -> tuple[Tensor, Tensor]:
    """(decided [R] bool, mask [R, V] bool): kept_mask of the rows it decides from their first w < V ranks
    (mass [R]: each whole row's float64 sum)."""
    R, V = probs.shape
    vals, ids = torch.topk(probs, w + 1, dim=-1)  # [R, w + 1] largest first; ties in no set order
    cut = vals[:, w]  # [R] the first value left out
    s, ranked = vals[:, :w], ids[:, :w]  # [R, w]
    if not bool((s[:, 1:] < s[:, :-1]).all()):  # equal values among them: order those by id
        by_id = ranked.argsort(dim=-1)  # the candidates by id, then stably by value
        ranked, s = ranked.gather(1, by_id), s.gather(1, by_id)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices
        s, ranked = s.gather(1, order), ranked.gather(1, order)  # the stable ranking's first w ranks
    certain = (s > cut[:, None]).sum(-1)  # [R] ranks before any value tied with the one left out
    keep = _kept_ranks(s, mass, V, top_k, top_p, min_p)  # [R, w]
    kept = keep.sum(-1)  # [R] L: a prefix (every rule keeps one)
    decided = (kept >= 1) & (kept < w) & (kept <= certain) & ((top_k >= V) | (top_k <= w))
    mask = torch.zeros(R, V, dtype=torch.bool, device=probs.device).scatter_(1, ranked, keep & decided[:, None])
    return decided, mask


def _kept_by_sort(probs: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, mass: Tensor | None = None) -> Tensor:
    """kept_mask by a stable sort of the whole rows (mass [R]: each row's float64 sum, if worked out already)."""
    if mass is None:
        mass = probs.sum(-1, dtype=torch.float64)
    s, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [R, V] each
    keep = _kept_ranks(s, mass, probs.shape[-1], top_k, top_p, min_p)
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def _kept_ranks(s: Tensor, mass: Tensor, V: int, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """[R, w] bool: the rule (module docstring) over each row's first w ranks s [R, w] (largest first) of a
    row of V probabilities whose whole float64 sum is mass [R]."""
    keep = torch.arange(s.shape[-1], device=s.device)[None, :] < top_k[:, None]  # [R, w] top-k
    topped = top_k < V  # [R] a top-k is on: the renormalising sum is its ranks'
    # The renormalising sum in float64, so a prefix of the ranks and all V of them give the same one.
    if bool(topped.any()):
        mass = torch.where(topped, (s.to(torch.float64) * keep).sum(-1), mass)
    s = s / mass.float()[:, None]  # renormalised after top-k (float32)
    s64 = s.to(torch.float64)
    before = torch.cumsum(s64, dim=-1) - s64  # [R, w] mass strictly before each rank
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return keep & (s >= min_p[:, None] * s[:, :1])
