"""A session's proposal as a batched draft grows it, one step (token and q row) at a time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specd.core.phases import PhaseLog
from specd.core.sampling import compact_q
from specd.core.sampling.greedy import top_probability
from specd.core.sampling.proposal import Proposal


@dataclass
class GrowingDraft:
    """One session's tokens and q rows, growing step by step in a batched draft."""

    tokens: list[int] = field(default_factory=list)
    q_ids: list[Tensor] = field(default_factory=list)  # per position [W_i] int64
    q_probs: list[Tensor] = field(default_factory=list)  # per position [W_i] float32 integer weights
    q_ms: float = 0.0  # time spent building q and sampling from it
    confidence: list[float] = field(default_factory=list)  # per position: the draft's P(its token)
    guess_first: bool = False  # its first token guesses the target's bonus (steps.ProposeRequest.guess_bonus)
    compact: list[compact_q.CompactRow] = field(default_factory=list)  # q rows 0 .. n - 1 in the wire's form

    def proposal(self, log: PhaseLog) -> Proposal:
        compute_ms = (log.phases[-1].end_ns - log.phases[0].start_ns) / 1e6 if log.phases else 0.0
        confidence = tuple(self.confidence) if len(self.confidence) == len(self.tokens) else ()
        if not self.q_ids:
            return Proposal(self.tokens, compute_ms=compute_ms, phases=log, confidence=confidence)
        # Positions have their own widths: pad to the widest with weight-0 slots.
        width = max(int(r.shape[0]) for r in self.q_ids)
        ids = torch.zeros(len(self.q_ids), width, dtype=torch.int64)  # [K, W]
        weights = torch.zeros(len(self.q_ids), width, dtype=torch.float32)  # [K, W]
        for k, (r_ids, r_w) in enumerate(zip(self.q_ids, self.q_probs)):
            ids[k, : r_ids.shape[0]] = r_ids
            weights[k, : r_w.shape[0]] = r_w
        compact = tuple(self.compact) if len(self.compact) == len(self.q_ids) else None
        return Proposal(
            self.tokens, ids, weights, compute_ms, phases=log, q_ms=self.q_ms, confidence=confidence, compact_q=compact
        )


def encode_pending(drafts: Iterable[GrowingDraft]) -> None:
    """Put every draft's q rows that are not in the wire's compact form yet into it, all in one pass.

    A drafter that encodes while its next pass runs (ModelDrafter's encode_q) calls this beside
    each step's forward, so that only the last step's rows are encoded after the draft."""
    todo = [(d, i) for d in drafts for i in range(len(d.compact), len(d.q_ids))]
    if not todo:
        return
    rows = compact_q.to_compact_each([(d.q_ids[i][None], d.q_probs[i][None]) for d, i in todo])  # [1] each
    for (d, _), [row] in zip(todo, rows):
        d.compact.append(row)


@dataclass
class DueConfidence:
    """Greedy rows whose confidence (the softmax probability of the argmax) is still to be worked out.

    A greedy step needs only its argmax to go on; the confidence, a full softmax pass over each row
    (0.15 ms for 8 rows of 32,000 on this host, hot), can wait for the next step's pass and run
    beside it (the runner's `beside`), as the q rows' encoding does. Settled in step order, so each
    draft's confidences stay in token order; what the last step leaves is settled after the draft.
    """

    rows: list[tuple[Tensor, Tensor, list[GrowingDraft | None]]] = field(default_factory=list)

    def add(self, logits: Tensor, best: Tensor, drafts: list[GrowingDraft | None]) -> None:
        """logits [G, V], best [G] their argmax, drafts [G] the draft each row's token went to (None: none)."""
        self.rows.append((logits, best, drafts))

    def settle(self) -> None:
        for logits, best, drafts in self.rows:
            for d, conf in zip(drafts, top_probability(logits, best).tolist()):
                if d is not None:
                    d.confidence.append(conf if conf == conf else 0.0)  # NaN: none
        self.rows.clear()
