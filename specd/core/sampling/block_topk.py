"""A few largest values of wide rows on the CPU, through block maxima: torch.topk's values at a fraction of its cost.

torch.topk on the CPU walks every element of a row with a heap as wide as k: for the draft's
branch ranking (the top 64 of each of K + 1 rows of 32,000 logits) that is ~65 us a row on this
host, most of a ranking's host time. Here a row is cut into blocks of `_BLOCK` values; one max
pass gives each block's peak; the k blocks with the highest peaks hold the row's k largest
values (a value outside them has k block peaks at or above it, each a different value, so at
least k values are at least as large); one top-k over those k blocks finds them.

The values are exactly torch.topk's, largest first. Among equal values the ids may name other
positions than torch.topk's would (it does not promise an order among ties either), so this is
for rankings that choose what to draft, never for a token that is emitted. A NaN makes its
block's peak NaN, which torch.topk ranks first: a row with a NaN still has a NaN first.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["block_topk"]

_BLOCK = 32  # values per block: 32,000 -> 1,000 peaks; k = 64 -> 2,048 candidates
_MIN_BLOCKS_PER_K = 4  # fewer blocks than this many per k: pruning saves too little, take torch.topk


def block_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k, dim=-1) of rows x [R, V]: (values [R, k], ids [R, k] int64), largest first.

    Values equal torch.topk's; ids may differ among equal values (module docstring). Rows that
    are not on the CPU, or not a whole number of blocks, or too few of them, take torch.topk.
    """
    assert x.dim() == 2 and 0 < k <= x.shape[-1], f"need [R, V] rows and 0 < k <= V, got {tuple(x.shape)}, k={k}"
    rows, width = x.shape
    blocks = width // _BLOCK
    if x.device.type != "cpu" or width % _BLOCK or blocks < _MIN_BLOCKS_PER_K * k:
        return torch.topk(x, k, dim=-1)
    peaks = x.reshape(rows, blocks, _BLOCK).amax(-1)  # [R, blocks]
    best = torch.topk(peaks, k, dim=-1).indices  # [R, k] the blocks that hold the k largest values
    cols = (best[:, :, None] * _BLOCK + torch.arange(_BLOCK)).reshape(rows, k * _BLOCK)  # [R, k * _BLOCK]
    values, at = torch.topk(torch.gather(x, 1, cols), k, dim=-1)  # [R, k] each
    return values, torch.gather(cols, 1, at)
