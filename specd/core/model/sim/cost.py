"""How long an emulated forward pass takes: a small, batch-aware cost model.

One forward pass over a batch of B sequences, sequence b running n_b new
positions (1 for a decode step, K + 1 for a verify, N + 1 for the verify of
a draft tree of N nodes, the prompt for a prefill) after c_b cached ones, takes

    t = fixed_ms
      + per_seq_ms      * B
      + per_kv_token_ms * sum_b (c_b + n_b)
      + per_token_ms    * max(0, sum_b n_b - free_tokens)

The first three terms are the memory-bound part of a GPU step: reading the
weights once (fixed), per-sequence work, and reading each sequence's KV
cache (attention). The last is the compute-bound part: a GPU absorbs the
first `free_tokens` positions of a pass into the weight read (that is why
verifying K + 1 tokens costs about one decode step), and every position
past that costs `per_token_ms` (the prefill rate). A CPU is compute-bound
from the first token: free_tokens = 0 and the fixed part is small.

A tree costs its node count: its N nodes are N new positions in one pass,
whatever its shape (the tree mask hides positions from each other but the
kernels still run every row), so a tree of N nodes costs what a chain of
K = N drafts costs, and pays when its accepted depth beats the chain's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specd.core.errors import InvalidArgument

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    fixed_ms: float  # one pass, any batch: the weight read (GPU) or fixed overheads (CPU)
    per_token_ms: float = 0.0  # each new position past free_tokens (compute)
    free_tokens: int = 0  # positions a pass absorbs before compute grows (0 on CPU)
    per_seq_ms: float = 0.0  # each sequence in the batch
    per_kv_token_ms: float = 0.0  # each position a sequence attends over (KV read)

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_token_ms", "per_seq_ms", "per_kv_token_ms"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"cost model {name} must be a number >= 0, got {value!r}")
        if isinstance(self.free_tokens, bool) or not isinstance(self.free_tokens, int) or self.free_tokens < 0:
            raise InvalidArgument(f"cost model free_tokens must be an int >= 0, got {self.free_tokens!r}")

    def forward_ms(self, new_tokens: Sequence[int], lengths: Sequence[int]) -> float:
        """Milliseconds of one pass: new_tokens[b] positions run for sequence b, lengths[b] its length after."""
        if len(new_tokens) != len(lengths):
            raise InvalidArgument("need one length per sequence")
        if not new_tokens:
            return 0.0
        compute = max(0, sum(new_tokens) - self.free_tokens)
        return (
            self.fixed_ms
            + self.per_seq_ms * len(new_tokens)
            + self.per_kv_token_ms * sum(lengths)
            + self.per_token_ms * compute
        )

    def verify_ms(self, nodes: Sequence[int], lengths: Sequence[int]) -> float:
        """One verify pass: sequence b checks nodes[b] draft tokens (a chain's K or a tree's node count)
        after lengths[b] committed tokens, its last one uncached (as the target runs it)."""
        if len(nodes) != len(lengths):
            raise InvalidArgument("need one length per sequence")
        return self.forward_ms([n + 1 for n in nodes], [c + n for c, n in zip(lengths, nodes)])

    def scaled(self, factor: float) -> CostModel:
        """Every time term times `factor` (free_tokens unchanged)."""
        if factor < 0:
            raise InvalidArgument(f"time scale must be >= 0, got {factor}")
        return CostModel(
            self.fixed_ms * factor,
            self.per_token_ms * factor,
            self.free_tokens,
            self.per_seq_ms * factor,
            self.per_kv_token_ms * factor,
        )

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CostModel:
        known = {"fixed_ms", "per_token_ms", "free_tokens", "per_seq_ms", "per_kv_token_ms"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"unknown cost model fields {unknown}; known: {sorted(known)}")
        if "fixed_ms" not in data:
            raise InvalidArgument("a cost model needs fixed_ms")
        return CostModel(**data)
