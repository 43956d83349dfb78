"""What a drafter hands to the verifier: K draft tokens and, optionally, sparse q."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from specd.core.errors import InvalidArgument
from specd.core.phases import PhaseLog
from specd.core.sampling.compact_q import CompactRow
from specd.core.transit import Transit

# What a proposal from the wire may hold unless the service says otherwise: K draft
# tokens, and entries per q row (also capped by the vocabulary). Together they bound
# the dense q a message can make anyone allocate: 256 x 4096 x 12 bytes = 12 MiB.
DEFAULT_MAX_DRAFT_TOKENS = 256
DEFAULT_MAX_Q_WIDTH = 4096

# One q row from the wire: (token ids, probabilities or integer weights), as lists, wire fields or tensors.
QRow = tuple[Sequence[int] | torch.Tensor, Sequence[float] | torch.Tensor]


@dataclass(frozen=True)
class Proposal:
    """K draft tokens after a committed prefix.

    q_ids / q_probs give, per draft position, the sparse distribution the token
    was sampled from (probability of q_ids[i, j] is q_probs[i, j] / q_probs[i].sum());
    None means one-hot at each draft token (n-gram drafts, greedy drafts). A
    model draft's q_probs are integer weights (specd.core.sampling.sparse_q), which the
    wire carries in its compact form.

    wire_q holds instead, per draft position, q exactly as it arrived from a draft
    service (opaque wire rows), for a transport that relays it to the target without
    decoding it: q_ids / q_probs are then None, and the target validates the rows.
    """

    token_ids: list[int]
    q_ids: torch.Tensor | None = None  # [K, W] int64
    q_probs: torch.Tensor | None = None  # [K, W] float32 (the wire values)
    compute_ms: float = 0.0
    phases: PhaseLog = field(default_factory=PhaseLog, compare=False, repr=False)  # where the time went
    q_ms: float = field(default=0.0, compare=False)  # draft time building q and sampling from it (part of compute_ms)
    transit: Transit | None = field(default=None, compare=False, repr=False)  # the call's hops (a transport's port)
    wire_q: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)  # [K] q rows as received, relayed
    # [K] or (): the drafter's own P(token i accepted | the ones before were), raw; auto calibrates and cuts by it
    confidence: tuple[float, ...] = field(default=(), compare=False)
    # [K] q in the wire's compact form: a draft service's drafter's (q_ids / q_probs too), encoded while its
    # next pass ran; or a verify's as it arrived (q_ids None), for the verifier to decode beside its forward
    compact_q: tuple[CompactRow, ...] | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    def window(self, start: int, stop: int | None = None, *, compute_ms: float = 0.0) -> Proposal:
        """Draft tokens [start:stop] with their q rows (e.g. a pre-draft minus its first token)."""
        q_ids = None if self.q_ids is None else self.q_ids[start:stop]
        q_probs = None if self.q_probs is None else self.q_probs[start:stop]
        wire_q = None if self.wire_q is None else self.wire_q[start:stop]
        confidence = self.confidence[start:stop]
        compact_q = None if self.compact_q is None else self.compact_q[start:stop]
        return Proposal(
            self.token_ids[start:stop],
            q_ids,
            q_probs,
            compute_ms,
            wire_q=wire_q,
            confidence=confidence,
            compact_q=compact_q,
        )

    def cut(self, n: int) -> Proposal:
        """The first n draft tokens, with everything the call measured (the rest is never verified)."""
        if n >= len(self):
            return self
        q_ids = None if self.q_ids is None else self.q_ids[:n]
        q_probs = None if self.q_probs is None else self.q_probs[:n]
        wire_q = None if self.wire_q is None else self.wire_q[:n]
        return replace(
            self,
            token_ids=self.token_ids[:n],
            q_ids=q_ids,
            q_probs=q_probs,
            wire_q=wire_q,
            confidence=self.confidence[:n],
            compact_q=None if self.compact_q is None else self.compact_q[:n],
        )

    @staticmethod
    def from_wire(
        token_ids: Sequence[int],
        q: Sequence[QRow],
        vocab_size: int,
        *,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        max_q_width: int = DEFAULT_MAX_Q_WIDTH,
    ) -> Proposal:
        """Build (and validate) a proposal from per-position (ids, probs) pairs.

        The sizes are checked first, from lengths alone, before anything is
        copied or allocated: at most max_draft_tokens tokens, and at most
        min(max_q_width, vocab_size) entries per q row, so the dense
        [K, W] tensors built here (and the batch's padded copy) stay within
        max_draft_tokens x max_q_width entries whatever a message says.
        """
        k = len(token_ids)
        check_sizes(k, len(q), max_draft_tokens)
        cap = min(max_q_width, vocab_size)
        width = 0
        for i, (ids, probs) in enumerate(q):
            if len(ids) != len(probs) or len(ids) == 0:
                raise InvalidArgument(f"q at draft position {i}: need equal, non-zero numbers of token_ids and probs")
            check_row_width(i, len(ids), cap)
            width = max(width, len(ids))
        tokens = checked_tokens(token_ids, vocab_size)
        if not q:
            return Proposal(tokens)
        q_ids = torch.zeros(k, width, dtype=torch.int64)
        q_probs = torch.zeros(k, width, dtype=torch.float32)
        for i, (ids, probs) in enumerate(q):
            row_ids = _as_tensor(ids, torch.int64, np.int64)
            row_probs = _as_tensor(probs, torch.float32, np.float32)
            if bool((row_ids >= vocab_size).any()) or bool((row_ids < 0).any()):
                raise InvalidArgument(
                    f"q at draft position {i} names a token id outside the vocabulary [0, {vocab_size})"
                )
            if not bool(torch.isfinite(row_probs).all()) or bool((row_probs < 0).any()) or float(row_probs.sum()) <= 0:
                raise InvalidArgument(f"q at draft position {i}: probabilities must be finite, >= 0 and not all 0")
            if not bool((row_ids == tokens[i]).logical_and(row_probs > 0).any()):
                raise InvalidArgument(f"draft token {tokens[i]} at position {i} has probability 0 in its own q")
            q_ids[i, : len(ids)] = row_ids
            q_probs[i, : len(ids)] = row_probs
        return Proposal(tokens, q_ids, q_probs)

    def to_wire(self) -> list[tuple[list[int], list[float]]]:
        """Per-position (ids, probs), dropping zero-probability padding slots."""
        if self.q_ids is None or self.q_probs is None:
            return []
        out = []
        for ids, probs in zip(self.q_ids.tolist(), self.q_probs.tolist()):
            kept = [(i, p) for i, p in zip(ids, probs) if p > 0]
            out.append(([i for i, _ in kept], [p for _, p in kept]))
        return out


def check_sizes(k: int, q_rows: int, max_draft_tokens: int) -> None:
    """A proposal's size from lengths alone: at most max_draft_tokens tokens, one q row per token or none."""
    if k > max_draft_tokens:
        raise InvalidArgument(f"{k} draft tokens; this service verifies at most {max_draft_tokens}")
    if q_rows not in (0, k):
        raise InvalidArgument(f"q has {q_rows} positions for {k} draft tokens; send one per token or none")


def check_row_width(i: int, width: int, cap: int) -> None:
    """q row i holds at most cap entries (min(max_q_width, vocab_size))."""
    if width > cap:
        raise InvalidArgument(f"q at draft position {i} has {width} entries; the limit is {cap}")


def checked_tokens(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The draft token ids as ints, each in [0, vocab_size) (one min/max pass; the culprit named on failure)."""
    tokens = [int(t) for t in token_ids]
    if tokens and not (min(tokens) >= 0 and max(tokens) < vocab_size):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise InvalidArgument(f"draft token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tokens


def _as_tensor(
    values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype, np_dtype: type
) -> torch.Tensor:
    """A q row as a 1-D tensor: a tensor as it is (cast), anything else (a list, a wire field) through numpy."""
    if isinstance(values, torch.Tensor):
        return values.to(dtype)
    return torch.from_numpy(np.asarray(values, dtype=np_dtype))
