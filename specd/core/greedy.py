"""The sampler's greedy limit, read straight off the logits.

At temperature 0 the processed p is one-hot at the float32 argmax (lowest id
on ties; specd.core.sampling.processed_probs), so the rejection sampler's
verdict needs no probabilities at all: a draft token is accepted iff it is the
argmax at its position (p(x) = 1 >= u; p(x) = 0 < u otherwise), and the
recovered token (residual max(0, p - q) = p, since q sits on the rejected
draft token) and the bonus token are the argmax where the run of accepts
stops. These functions give exactly those answers from one argmax and one max
per row, instead of a softmax, a one-hot, a residual and a float64 cumsum over
the vocabulary: what a CPU host saves per greedy step grows with the
vocabulary (tests/test_sampling.py checks they equal the general path).

A row whose logits hold NaN or +inf, or only -inf at some position, cannot be
sampled (as in specd.core.sampling.unusable_rows): it is reported, and its
other numbers are meaningless.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specd.core.rejection import Verdict

__all__ = ["greedy_tokens", "greedy_verdict"]


def greedy_tokens(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (argmax [...] int64, unusable [...] bool: NaN, +inf, or no finite logit)."""
    # One pass: the max (NaN if any logit is NaN, +inf if any is +inf, -inf if all are) and
    # where it is (the first maximal index: the lowest id on ties, as argmax).
    top, best = logits.to(torch.float32).max(-1)
    return best, ~top.isfinite()


def greedy_verdict(logits: Tensor, draft_token_ids: Tensor, num_draft: Tensor) -> tuple[Verdict, Tensor]:
    """rejection_sample's verdict for rows that are all greedy, from their logits.

    logits:          [B, K+1, V] the target's logits at each draft position and one more
    draft_token_ids: [B, K] int64 (slots >= num_draft[b] are padding)
    num_draft:       [B] int64 real drafts per row
    returns:         (Verdict, unusable [B] bool: a row whose logits cannot be sampled)
    """
    B, K1, _ = logits.shape
    K = K1 - 1
    assert draft_token_ids.shape == (B, K) and num_draft.shape == (B,)
    best, bad = greedy_tokens(logits)  # [B, K+1] each
    real = torch.arange(K)[None, :] < num_draft[:, None]  # [B, K]
    accepted = real & (draft_token_ids == best[:, :K])  # [B, K]
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B] leading run of accepts
    next_token = best.gather(1, num_accepted[:, None]).squeeze(1)  # [B] argmax where the run stops
    verdict = Verdict(num_accepted=num_accepted, next_token=next_token, is_bonus=num_accepted == num_draft)
    return verdict, bad.any(-1)
