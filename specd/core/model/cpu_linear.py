"""Linear layers over a few rows, on CPU: kernels that stream the weights once per pass.

`F.linear(x, W)` over x of n rows computes x @ W.T. On the CPU BLAS that
torch ships (MKL) on an AMD CPU, for the rows of a decode step or a verify
that product is slow and grows with n, up to several times the time it
takes to stream W once; on an Intel CPU, only past a few rows. By
`CPU_LINEARS` kind (measured: docs/results/verify-cost.md):

- `packed` (the default): 1 to `PACKED_GEMV_ROWS` rows by the few-row
  kernel below, the fastest decode step. More rows run
  oneDNN's linear over a copy of W packed once in its blocked layout
  (`torch.ops.mkldnn`), whose time grows with the rows only by the
  arithmetic: on two cores of an AMD EPYC a 9-token verify costs 1.5
  decode steps (2.5 with `few-row`; 1.8 on an Intel Xeon), and a prefill
  is faster than torch's kernel. The copy
  holds the layer's weight a second time; it is made on first use and
  again whenever the weight changes (in place or replaced).
- `few-row`: 1 to `GEMV_ROWS` rows by the few-row kernel, no copy; more
  rows run torch's own linear.
- `torch`: torch's own linear throughout (nothing installed).

The few-row kernel depends on the CPU (`few_row_kernel`). Off Intel CPUs,
MKL's linear over a few rows takes a slow path, so they run as
(W @ x.T).T, a single row doubled so that it is a GEMM and not a
matrix-vector product: it streams W once (AMD EPYC: 24.4 against 46.1 ms a
pass over the demo target's linears at 1 row). On Intel CPUs MKL's own
kernel is the fast one and the transposed product the slow one (Xeon, AVX-512:
21.6 against 61.4 ms at 1 row, 27.3 against 57.7 at 3;
`scripts/linear_kernels.py`), so there the few rows keep torch's linear.

Without oneDNN (`torch.backends.mkldnn`), or while autograd records, the
rows `packed` would send to oneDNN run torch's own linear. The values are
those of the same sums in another order (float rounding only); specd's
target-only decoding runs the same kernels, so exactness within specd is
unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from specd.core.errors import InvalidArgument

__all__ = [
    "CPU_LINEARS",
    "FEW_ROW_KERNELS",
    "GEMV_ROWS",
    "PACKED_GEMV_ROWS",
    "PACK_ROWS_HINT",
    "few_row_kernel",
    "install_small_row_linears",
]

CPU_LINEARS = ("packed", "few-row", "torch")  # the services' --cpu-linear choices; the first is the default
# Row counts up to these run by the few-row kernel: without a packed copy, and with one (fastest at 1-3 rows, in the forward).
GEMV_ROWS = 8
PACKED_GEMV_ROWS = 3
# oneDNN packs a weight for a batch-size hint; 8 was as fast as a per-count packing from 3 to 17 rows.
PACK_ROWS_HINT = 8
# How the few rows run: (W @ x.T).T, or torch's own linear (the module docstring says when each).
FEW_ROW_KERNELS = ("transposed", "torch")


def few_row_kernel(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The faster few-row kernel on this CPU: `torch` on an Intel CPU, `transposed` elsewhere.

    The vendor, not a timing, decides: every process on a machine makes the same choice, so a
    target-only run and a speculative one round their sums alike.
    """
    try:
        with cpuinfo.open() as f:
            intel = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:  # not Linux: the kernel the project was first measured with
        intel = False
    return "torch" if intel else "transposed"


def _packed_weight(layer: torch.nn.Linear) -> Tensor:
    """The layer's weight in oneDNN's layout, packed again if the weight changed since (in place or replaced)."""
    weight = layer.weight
    key = (weight.data_ptr(), weight._version)
    cached: tuple[tuple[int, int], Tensor] | None = getattr(layer, "_specd_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT))
        layer._specd_packed = cached  # type: ignore[assignment]  # not a buffer: kept out of state_dict
    return cached[1]


def _small_row_forward(gemv_rows: int, onednn: bool, transposed: bool) -> Callable[[torch.nn.Linear, Tensor], Tensor]:
    """A Linear's forward: up to gemv_rows rows as (W @ x.T).T (transposed) or torch's; more on the packed
    weight (onednn) or torch's."""

    def forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if 0 < n <= gemv_rows and not transposed:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if n == 0 or n > gemv_rows:
            tracked = torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)
            dense = x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu"
            if n == 0 or tracked or not (onednn and dense):
                return torch.nn.functional.linear(x, self.weight, self.bias)
            packed = _packed_weight(self)
            y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, self.bias, "none", [], "")
            return y.reshape(*x.shape[:-1], -1)
        if n == 1:  # a matrix-vector product would take the slow path: two equal rows, one kept
            rows = rows.repeat(2, 1)
        # Contiguous, as F.linear's output is: the model may view() it, and a collective reduces it in place.
        y = (self.weight @ rows.T).T[:n].contiguous()
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], -1)  # the weight's rows: a tensor-parallel shard holds fewer than out_features

    return forward


def install_small_row_linears(model: torch.nn.Module, kind: str = CPU_LINEARS[0], few_rows: str | None = None) -> int:
    """Route every nn.Linear of a CPU model through the `kind` kernels; the number of layers changed.

    few_rows: the few-row kernel (FEW_ROW_KERNELS; default: `few_row_kernel()`, this CPU's).
    A no-op (0) for `torch`, and for a model that is not on the CPU: GPU kernels have no such gap.
    """
    if kind not in CPU_LINEARS:
        raise InvalidArgument(f"--cpu-linear must be one of {', '.join(CPU_LINEARS)}, got {kind!r}")
    if few_rows is not None and few_rows not in FEW_ROW_KERNELS:
        raise InvalidArgument(f"the few-row kernel must be one of {', '.join(FEW_ROW_KERNELS)}, got {few_rows!r}")
    first = next(model.parameters(), None)
    if kind == "torch" or first is None or first.device.type != "cpu":
        return 0
    transposed = (few_rows or few_row_kernel()) == "transposed"  # the CPU is read only for a CPU model
    onednn = kind == "packed" and torch.backends.mkldnn.is_available()
    count = 0
    for module in model.modules():
        # Plain layers only, not subclasses with a forward of their own; again is a no-op.
        if type(module) is torch.nn.Linear and "forward" not in vars(module):
            packs = onednn and module.weight.layout == torch.strided
            forward = _small_row_forward(PACKED_GEMV_ROWS if packs else GEMV_ROWS, packs, transposed)
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            count += 1
    return count
