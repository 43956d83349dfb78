"""specd.core.sampling.block_topk: torch.topk's values through block maxima; ids hold them, each once."""

from __future__ import annotations

import math

import pytest
import torch

from specd.core.sampling.block_topk import block_topk


def _rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    clustered = torch.randn(2, 32000, generator=g)
    clustered[0, 640:704] += 50.0  # every one of the top 64 in two neighbouring blocks
    clustered[1, ::500] += 50.0  # one in each of 64 blocks
    return {
        "logits": torch.randn(3, 32000, generator=g) * torch.tensor([0.1, 3.0, 1e4])[:, None],
        "probs": torch.softmax(torch.randn(3, 32000, generator=g) * 3, -1),
        "clustered": clustered,
        "all equal": torch.full((1, 4096), 0.25),
        "ties at the cut": torch.cat([torch.full((1, 70), 2.0), torch.full((1, 4026), 1.0)], -1),
        "zeros past a filter": torch.cat([torch.rand(1, 5, generator=g), torch.zeros(1, 4091)], -1),
        "-inf but a few": torch.cat([torch.full((1, 4093), -math.inf), torch.tensor([[1.0, 2.0, 0.5]])], -1),
        "odd width (torch.topk)": torch.randn(2, 3001, generator=g),
    }


@pytest.mark.parametrize("name", list(_rows()))
@pytest.mark.parametrize("k", [1, 8, 64, 200])
def test_values_are_torch_topks_and_the_ids_hold_them(name: str, k: int) -> None:
    x = _rows()[name]
    values, ids = block_topk(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values)  # largest first, the very same numbers
    assert torch.equal(x.gather(1, ids), values)  # the ids hold those values (ties may trade places)
    assert all(len(set(row)) == k for row in ids.tolist())  # each position once
    assert ids.dtype == torch.int64


def test_a_nan_or_an_infinity_comes_first_as_with_torch_topk() -> None:
    x = torch.randn(3, 32000, generator=torch.Generator().manual_seed(4))
    x[0, 12345] = math.nan
    x[1, 777] = math.inf
    x[2] = -math.inf
    values, ids = block_topk(x, 64)
    assert math.isnan(values[0, 0]) and int(ids[0, 0]) == 12345
    assert values[1, 0] == math.inf and int(ids[1, 0]) == 777
    assert not values[2].isfinite().any()
    assert not values[:, 0].isfinite().any()  # the ranking's refusal reads exactly this


def test_rows_that_are_views_of_a_wider_tensor() -> None:
    """The rows a drafter hands over may be a slice (a batched forward's split output)."""
    wide = torch.randn(6, 32000, generator=torch.Generator().manual_seed(5))
    rows = wide[1:4]
    strided = wide[::2]
    for x in (rows, strided, wide.t().contiguous().t()[:, :31968]):
        values, ids = block_topk(x, 64)
        assert torch.equal(values, torch.topk(x, 64, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values)
