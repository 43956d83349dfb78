"""The logits rows a draft sequence already computed, kept for its next branch call's ranking.

A speculation cache's branch call ranks the verdicts of the K tokens being
verified by the draft's rows at their positions and at the one after them
(specd.core.draft.branching). The first K are the rows the draft sampled those
very tokens from; only the last (the bonus position, after the last pending
token) is new. So a sequence keeps the rows of the tokens it drafts, the draft
computes the bonus row while it is idle (the target is verifying), and the
branch call then ranks without a forward pass: K draft passes instead of
K + 1, which is what lets its branches reach the target before the verdict on
the emulated 70B pair (docs/results/round-profile.md).

Row i predicts the token at position `start + i` and depends on the tokens
before it only, so rows stay valid while the sequence keeps those tokens:
`rewound(position)` drops the rows after the first position a sync changed.
Rows are copies (a forward's output tensor is not pinned by one kept row), but
a branch's rows are views: a branch call keeps a row for every branch at every
step (B x K copies of V floats were ~0.4 ms of a K = 2, B = 8 call at V = 32,000,
in-process over an emulated draft on this machine), and its branches live only until the session's next call,
which drops all of them but the one it adopts and copies that one's rows
(`owned()`). So views pin one call's outputs at most. At most `KEEP` rows per
sequence: a branch call of up to 32 pending tokens (the draft's default
--max-draft-tokens) and its bonus row; a longer one reads its rows again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

KEEP = 33  # rows per sequence at most (32 pending tokens and the bonus row)


@dataclass
class RankingRows:
    """Consecutive logits rows of one sequence: rows[i] [V] predicts the token at position start + i."""

    start: int = 0
    rows: list[Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        """One past the last position a row predicts."""
        return self.start + len(self.rows)

    def keep(self, position: int, row: Tensor, *, view: bool = False) -> None:
        """The row predicting `position` (its predecessors' rows stay if they are consecutive with it);
        a copy, or with `view` the row itself (a branch's: module docstring)."""
        if not self.rows or position != self.end:
            if self.start <= position < self.end:
                del self.rows[position - self.start :]
            else:
                self.start, self.rows = position, []
        self.rows.append(row if view else row.clone())
        if len(self.rows) > KEEP:  # the oldest rows are no branch call's any more
            del self.rows[: len(self.rows) - KEEP]
            self.start = position + 1 - KEEP

    def keep_all(self, position: int, rows: Tensor) -> None:
        """Rows [n, V] predicting positions position .. position + n - 1."""
        for i in range(rows.shape[0]):
            self.keep(position + i, rows[i])

    def owned(self) -> RankingRows:
        """These rows as copies of their own (the forward outputs they viewed may then be freed)."""
        self.rows = [r.clone() for r in self.rows]
        return self

    def rewound(self, unchanged: int) -> None:
        """The sequence's first `unchanged` tokens are as before, the rest may not be: keep the rows that
        predict positions <= unchanged (each depends only on the tokens before its position)."""
        keep = unchanged - self.start + 1
        if keep <= 0:
            self.rows = []
        elif keep < len(self.rows):
            del self.rows[keep:]

    def span(self, first: int, count: int) -> Tensor | None:
        """Rows predicting positions first .. first + count - 1 as [count, V], or None if any is missing."""
        if count < 1 or first < self.start or first + count > self.end:
            return None
        return torch.stack(self.rows[first - self.start : first - self.start + count])
