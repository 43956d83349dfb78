"""The sampler's greedy limit, read straight off the logits.

At temperature 0 the processed p is one-hot at the float32 argmax (lowest id
on ties; specd.core.sampling.sampler.processed_probs), so the rejection sampler's
verdict needs no probabilities at all: a draft token is accepted iff it is the
argmax at its position (p(x) = 1 >= u; p(x) = 0 < u otherwise), and the
recovered token (residual max(0, p - q) = p, since q sits on the rejected
draft token) and the bonus token are the argmax where the run of accepts
stops. These functions give exactly those answers from one argmax and one max
per row, instead of a softmax, a one-hot, a residual and a float64 cumsum over
the vocabulary: what a CPU host saves per greedy step grows with the
vocabulary (tests/unit/core/sampling/test_sampling.py checks they equal the general path).

A row whose logits hold NaN or +inf, or only -inf at some position, cannot be
sampled (as in specd.core.sampling.sampler.unusable_rows): it is reported, and its
other numbers are meaningless.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["greedy_tokens", "greedy_verdict", "scaled_logsumexp", "top_probability"]

# torch's CPU exp takes a scalar slow path for inputs below about -87.3 (results under float32's
# smallest normal): ~35 ns an element against ~0.2, so a row scaled by a large inverse temperature
# (most of its tail 100+ below the max) took 1.3-1.9 ms for three rows of 32,000, where 0.06 ms will do.
# Terms this far below the row's max change no float32 sum (e^-80 x 10^6 < 2^-24), so the exponent
# is clamped here first.
_EXP_FLOOR = -80.0


def greedy_tokens(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (argmax [...] int64, unusable [...] bool: NaN, +inf, or no finite logit)."""
    # One pass: where the max is (the first maximal index: the lowest id on ties, as argmax; the
    # first NaN if any) and its value (NaN if any logit is NaN, +inf if any is +inf, -inf if all are).
    x = logits.to(torch.float32)
    if x.device.type == "cpu":  # numpy's argmax is vectorised, torch's CPU max-with-index is not: same answers
        a = x.detach().numpy()  # [..., V]
        at = np.asarray(a.argmax(-1))  # [...]
        value = np.take_along_axis(a, at[..., None], -1)[..., 0]  # [...]
        return torch.from_numpy(at), torch.from_numpy(np.asarray(~np.isfinite(value)))
    top, best = x.max(-1)
    return best, ~top.isfinite()


def scaled_logsumexp(x: Tensor, peak: Tensor, scale: float) -> Tensor:
    """log(sum(exp(scale * x))) over the last dim: [..., V] float32 -> [...], without exp's slow path.

    For rows whose finite max `peak` [...] the caller already has (a top-k's first column; a row
    without one cannot be sampled and is the caller's to refuse) and scale > 0. Equal to
    torch.logsumexp(scale * x) to float32 rounding (the module's _EXP_FLOOR); x is left as it was.
    """
    return (x - peak[..., None]).mul_(scale).clamp_(min=_EXP_FLOOR).exp_().sum(-1).log_() + scale * peak


def top_probability(logits: Tensor, best: Tensor) -> Tensor:
    """The softmax probability of each row's token `best`: softmax(logits)[best], float32.

    logits: [A, V]; best: [A] int64 (the argmax: the greedy token's probability at T = 1, a
    calibrated confidence). One fused pass over V; NaN for a row that cannot be sampled.
    """
    assert logits.dim() == 2 and best.shape == logits.shape[:1], (
        f"need [A, V] logits and [A] tokens, got {tuple(logits.shape)}, {tuple(best.shape)}"
    )
    return torch.softmax(logits.to(torch.float32), -1).gather(-1, best.to(logits.device)[:, None])[:, 0]


def greedy_verdict(logits: Tensor, draft_token_ids: Sequence[int]) -> tuple[int, int, bool] | None:
    """One session's verdict when it is greedy, from its logits alone (no padded batch tensor needed).

    logits:          [k+1, V] the target's logits at the session's k draft positions and one more
    draft_token_ids: its k draft tokens
    returns:         (accepted, recovered or bonus token, is_bonus), or None if its logits cannot be sampled
    """
    k = len(draft_token_ids)
    assert logits.dim() == 2 and logits.shape[0] == k + 1, f"logits must be [k+1, V] for k={k}"
    best, bad = greedy_tokens(logits)  # [k+1] each
    if bool(bad.any()):
        return None
    argmax = best.tolist()
    j = 0  # the leading run of drafts that are the argmax at their position
    while j < k and int(draft_token_ids[j]) == argmax[j]:
        j += 1
    return j, argmax[j], j == k
