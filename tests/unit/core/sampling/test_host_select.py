"""specd.core.sampling.host_select: the row's largest values through a histogram, exactly torch.topk's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specd.core.sampling import host_select


def _adversarial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "logits": torch.randn(4, 3000, generator=g) * torch.tensor([0.1, 1.0, 10.0, 1e4])[:, None],
        "probs": torch.softmax(torch.randn(3, 3000, generator=g) * 3, -1),
        "all equal": torch.full((1, 500), 0.25),
        "ties at the cut": torch.cat([torch.full((1, 40), 2.0), torch.full((1, 460), 1.0)], -1),
        "signed zeros and infinities": torch.tensor([[0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 3.0, -3.0]]),
        "-inf but a few": torch.cat([torch.full((1, 300), -math.inf), torch.tensor([[1.0, 2.0, 0.5]])], -1),
        "one bin": 1.0 + torch.rand(1, 2000, generator=g) * 1e-3,  # every value in one eighth of an octave
        "single token": torch.tensor([[0.7]]),
    }


@pytest.mark.parametrize("name", list(_adversarial()))
@pytest.mark.parametrize("k", [1, 3, 64, 1792, 10**6])
def test_the_candidates_hold_torch_topk(name: str, k: int) -> None:
    x = _adversarial()[name]
    k = min(k, x.shape[-1])
    for row in x:
        a = row.numpy()
        vals, ids = host_select.top_sorted(a, host_select.candidates(a, k), k)
        want = torch.topk(row, k)
        assert np.array_equal(vals, want.values.numpy())
        assert np.array_equal(a[ids], vals)  # the ids hold those values (ties may trade places)
        assert len(set(ids.tolist())) == k  # each id once


def test_the_bins_order_the_values() -> None:
    a = np.array([-math.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, math.inf], dtype=np.float32)
    b = host_select.bins(a)
    assert (np.diff(b) >= 0).all() and b.min() >= 0 and b.max() < 4096


def test_candidates_leave_out_at_most_the_mass_they_are_given() -> None:
    p = torch.softmax(torch.randn(20, 5000, generator=torch.Generator().manual_seed(4)) * 2, -1).numpy()
    for row in p:
        for mass in (1e-1, 1e-3, 1e-6, 0.0):
            ids = host_select.mass_candidates(row, 10**9, mass)  # the count never decides here
            assert ids is not None
            out = np.ones(row.size, dtype=bool)
            out[ids] = False
            assert row[out].sum(dtype=np.float64) <= mass
            assert row[out].max(initial=0.0) <= row[ids].min()
            assert bool(np.all(np.diff(ids) > 0))
