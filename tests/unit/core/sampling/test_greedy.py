"""The greedy fast path gives exactly the general sampler's answers (specd.core.sampling.greedy)."""

from __future__ import annotations

import math

import pytest
import torch

from specd.core.sampling.greedy import (
    greedy_tokens,
    greedy_verdict,
    scaled_logsumexp,
    top_probability,
)
from specd.core.sampling.rejection import rejection_sample
from specd.core.sampling.sampler import SamplingParams, processed_probs, unusable_rows

GREEDY = SamplingParams(temperature=0.0, seed=3)


def general(logits: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor):
    """The verdict and unusable rows by the general path: processed p (one-hot), then the rejection sampler."""
    B = logits.shape[0]
    p = processed_probs(logits, [GREEDY] * B)
    bad = unusable_rows(logits, p)
    ok = [b for b in range(B) if b not in bad]
    v = rejection_sample(
        p[ok],
        drafts[ok],
        None,
        seeds=torch.full((len(ok),), 3, dtype=torch.int64),
        start_positions=torch.arange(len(ok), dtype=torch.int64) * 7,
        num_draft=num_draft[ok],
    )
    return ok, v, set(bad)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_verdict_equals_the_rejection_sampler_on_one_hot_p(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, K, V = 16, 5, 40
    logits = torch.randn(B, K + 1, V, generator=g)
    logits[:, :, 7] = logits[:, :, 3]  # ties: the lower id wins on both paths
    best = logits.argmax(-1)
    # Drafts that agree with the argmax for a random leading run, then differ (or run to the end).
    drafts = best[:, :K].clone()
    for b in range(B):
        cut = int(torch.randint(0, K + 1, (1,), generator=g))
        if cut < K:
            drafts[b, cut] = (drafts[b, cut] + 1) % V
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    # Rows the sampler cannot use; padding past num_draft repeats the last real row, as the verifier pads.
    logits[2, 0, 5] = math.nan
    logits[4, 0, :] = -math.inf  # no finite logit at one position
    logits[6, 0, 0] = math.inf
    logits[8, 0, 9] = -math.inf  # one -inf is fine
    for b in range(B):
        logits[b, int(num_draft[b]) + 1 :] = logits[b, int(num_draft[b])]
    ok, want, want_bad = general(logits, drafts, num_draft)
    got = [
        greedy_verdict(logits[b, : int(num_draft[b]) + 1], drafts[b, : int(num_draft[b])].tolist()) for b in range(B)
    ]
    assert {b for b, v in enumerate(got) if v is None} == want_bad == {2, 4, 6}
    for r, b in enumerate(ok):
        assert got[b] == (int(want.num_accepted[r]), int(want.next_token[r]), bool(want.is_bonus[r]))


def test_greedy_tokens_are_the_argmax_of_the_processed_p() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(12, 50, generator=g)
    logits[3, 10] = logits[3, 40] = logits[3].max() + 1  # a tie
    logits[5, 2] = math.nan
    tokens, bad = greedy_tokens(logits)
    p = processed_probs(logits[:, None, :], [GREEDY] * 12)
    assert bad.tolist() == [b == 5 for b in range(12)]
    keep = [b for b in range(12) if b != 5]
    assert torch.equal(tokens[keep], p[keep, 0].argmax(-1))
    assert int(tokens[3]) == 10


def test_greedy_tokens_on_the_host_equal_torch_max() -> None:
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(8, 50, generator=g)
    rows[0, [3, 40]] = 9.0  # a tie: the lower id
    rows[1, 7] = math.nan
    rows[2, 9] = math.inf
    rows[3] = -math.inf
    rows[4, :49] = -math.inf
    for x in (rows, rows.to(torch.bfloat16), rows[:, None, :].expand(8, 3, 50)):
        top, best = x.float().max(-1)
        got_best, got_bad = greedy_tokens(x)
        assert torch.equal(got_bad, ~top.isfinite())
        assert torch.equal(got_best[~got_bad], best[~got_bad])


def test_the_greedy_confidence_is_the_softmax_top_probability() -> None:
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2)) * 4
    best, _ = greedy_tokens(logits)
    want = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))
    assert torch.allclose(top_probability(logits, best), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("scale", [0.25, 1.0, 16.0, 48.0, 400.0])
def test_scaled_logsumexp_from_the_rows_max_equals_torch_logsumexp_of_the_scaled_rows(scale: float) -> None:
    # scale 16 and up: most of each row lies far below its max (where exp's slow path was)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 32000, generator=g) * 5.0
    x[1, :100] = float("-inf")  # -inf logits (a banned token) are fine beside finite ones
    before = x.clone()
    got = scaled_logsumexp(x, x.amax(-1), scale)
    torch.testing.assert_close(got, torch.logsumexp(scale * x, -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(x, before)  # x is left as it was
    assert scaled_logsumexp(x[0], x[0].amax(), scale).shape == ()
