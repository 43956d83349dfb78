#!/usr/bin/env python
"""Time the CPU linear kernels over a model's worth of weights: torch's, (W @ x.T).T and oneDNN's over packed weights.

The layers have the demo target's shapes (SmolLM2-135M: 30 layers of q, k, v,
o, gate, up and down, and the 49,152 x 576 LM head), with random weights,
distinct per layer so that a pass streams them from memory as a forward pass
does. Each sample runs every layer once over n rows; the kernels and row
counts are interleaved sample by sample. Prints the median ms per pass
(docs/results/verify-cost.md, 2026-12-05).

    .venv/bin/python scripts/linear_kernels.py [--rows 1,2,3,5,9,13,17] [--samples 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import ints

from specd.core.model.cpu_linear import PACK_ROWS_HINT

LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def transposed(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows = x if x.shape[0] > 1 else x.repeat(2, 1)
    return (w @ rows.T).T[: x.shape[0]].contiguous()


def onednn(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,5,9,13,17", help="row counts (comma-separated)")
    ap.add_argument("--samples", type=int, default=5, help="passes per kernel and row count (after 2 warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (default 30, the demo target's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = ints(args.rows)
    weights = [torch.randn(o, i) * 0.02 for _ in range(args.layers) for (o, i) in LAYER_SHAPES]
    weights.append(torch.randn(*HEAD_SHAPE) * 0.02)
    print(f"{len(weights)} layers, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB; packing ...", flush=True)
    packed_once = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    per_count = {n: [torch.ops.mkldnn._reorder_linear_weight(w, n) for w in weights] for n in rows}

    kernels: dict[str, Callable[[int, int, torch.Tensor], torch.Tensor]] = {
        "torch x @ W.T": lambda n, i, x: torch.nn.functional.linear(x, weights[i]),
        "(W @ x.T).T": lambda n, i, x: transposed(weights[i], x),
        "oneDNN, packed per n": lambda n, i, x: onednn(per_count[n][i], x),
        f"oneDNN, packed once (hint {PACK_ROWS_HINT})": lambda n, i, x: onednn(packed_once[i], x),
    }
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kernels for n in rows}
    rng = random.Random(0)
    for sample in range(args.samples + 2):
        for n in rng.sample(rows, len(rows)):
            inputs = {576: torch.randn(n, 576), 1536: torch.randn(n, 1536)}
            for name in rng.sample(list(kernels), len(kernels)):
                kernel = kernels[name]
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    kernel(n, i, inputs[w.shape[1]])
                if sample >= 2:
                    times[(name, n)].append((time.perf_counter() - t0) * 1e3)
    print("| rows | " + " | ".join(kernels) + " |")
    print("|---|" + "---|" * len(kernels))
    for n in rows:
        print(f"| {n} | " + " | ".join(f"{statistics.median(times[(k, n)]):.1f}" for k in kernels) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
