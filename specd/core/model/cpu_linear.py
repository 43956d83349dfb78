"""Linear layers over a few rows, on CPU, as one GEMM with the rows as its narrow side.

`F.linear(x, W)` over x of n rows computes x @ W.T. On the CPU BLAS that
torch ships, for the few rows of a decode step or a verify, that product is
slow and grows with n, up to several times the time it takes to stream W
once. The same product as (W @ x.T).T, with a single row doubled so that it
is a GEMM and not a matrix-vector product, streams the weights once: the
decode step gets faster, and so does every verify of up to 8 tokens, whose
cost then grows with its rows only by the arithmetic (measured:
docs/results/verify-cost.md).

The values are those of the same sums in another order (float rounding
only); specd's target-only decoding runs the same kernels, so exactness
within specd is unchanged.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

__all__ = ["SMALL_ROWS", "install_small_row_linears"]

# Row counts up to this run as (W @ x.T).T; more rows run as torch's own linear (as fast or faster from 8).
SMALL_ROWS = 8


def _small_row_forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > SMALL_ROWS or n == 0:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    if n == 1:  # a matrix-vector product would take the slow path: two equal rows, one kept
        rows = rows.repeat(2, 1)
    # Contiguous, as F.linear's output is: the model may view() it, and a collective reduces it in place.
    y = (self.weight @ rows.T).T[:n].contiguous()
    if self.bias is not None:
        y += self.bias
    return y.reshape(*x.shape[:-1], -1)  # the weight's rows: a tensor-parallel shard holds fewer than out_features


def install_small_row_linears(model: torch.nn.Module) -> int:
    """Route every nn.Linear of a CPU model through the few-row GEMM; the number of layers changed.

    A no-op (0) for a model that is not on the CPU: GPU kernels have no such gap.
    """
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return 0
    count = 0
    for module in model.modules():
        # Plain layers only, not subclasses with a forward of their own; again is a no-op.
        if type(module) is torch.nn.Linear and "forward" not in vars(module):
            module.forward = types.MethodType(_small_row_forward, module)  # type: ignore[method-assign]
            count += 1
    return count
