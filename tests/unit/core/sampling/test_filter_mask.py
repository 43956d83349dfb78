"""specd.core.sampling.filter_mask: the kept set from the first ranks equals the whole sort's, row by row."""

from __future__ import annotations

import math

import pytest
import torch

from specd.core.sampling import filter_mask
from specd.core.sampling.filter_mask import kept_mask


def _rows(V: int) -> torch.Tensor:
    """Rows that the first 32 or 256 ranks decide, that need 4,096, and that none does (flat ones, ties)."""
    g = torch.Generator().manual_seed(V)
    peaked = torch.randn(6, V, generator=g) * 8.0
    wide = torch.randn(6, V, generator=g) * 2.5  # top-p 0.8 reads hundreds of ranks
    flat = torch.randn(2, V, generator=g) * 0.05
    tied = torch.randn(4, V, generator=g).round()  # a few distinct values: ties at every cut
    plateau = torch.randn(2, V, generator=g)
    plateau[:, : min(V, 300)] = 5.0  # 300 equal top values: the first cut falls inside them
    return torch.softmax(torch.cat([peaked, wide, flat, tied, plateau]), -1)


SETTINGS = [  # (top_k, top_p, min_p); top_k 0: off
    (0, 0.8, 0.0),
    (0, 0.95, 0.0),
    (0, 0.3, 0.0),
    (0, 1.0, 0.05),
    (20, 1.0, 0.0),
    (300, 1.0, 0.0),  # past the first ranks
    (5000, 0.9, 0.0),
    (40, 0.9, 0.02),
    (1, 0.5, 0.0),
]


@pytest.mark.parametrize("V", [7, 2048, 8192, 32000])
@pytest.mark.parametrize("top_k, top_p, min_p", SETTINGS)
def test_the_kept_set_is_the_whole_sorts(V: int, top_k: int, top_p: float, min_p: float) -> None:
    probs = _rows(V)
    R = probs.shape[0]
    k = torch.full((R,), top_k if 0 < top_k < V else V, dtype=torch.int64)
    p = torch.full((R,), top_p, dtype=torch.float64)
    m = torch.full((R,), min_p, dtype=torch.float32)
    want = filter_mask._kept_by_sort(probs, k, p, m)
    assert torch.equal(kept_mask(probs, k, p, m), want)
    for r in range(R):  # and each row alone: nothing depends on its batch-mates
        assert torch.equal(kept_mask(probs[r : r + 1], k[:1], p[:1], m[:1])[0], want[r])


def test_rows_with_their_own_settings_and_each_way_of_deciding(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = _rows(32000)
    R = probs.shape[0]
    k = torch.tensor([(0, 20, 300, 5000)[r % 4] or 32000 for r in range(R)])
    p = torch.tensor([(0.8, 1.0, 0.95)[r % 3] for r in range(R)], dtype=torch.float64)
    m = torch.tensor([(0.0, 0.01)[r % 2] for r in range(R)], dtype=torch.float32)
    widths: list[tuple[int, int]] = []  # (w, rows decided there)
    first = filter_mask._kept_in_first

    def counted(*args: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        decided, mask = first(*args)  # type: ignore[arg-type]
        widths.append((int(args[-1]), int(decided.sum())))
        return decided, mask

    monkeypatch.setattr(filter_mask, "_kept_in_first", counted)
    got = kept_mask(probs, k, p, m)
    assert torch.equal(got, filter_mask._kept_by_sort(probs, k, p, m))
    assert [w for w, _ in widths] == [32, 256, 4096]
    assert all(n > 0 for _, n in widths) and sum(n for _, n in widths) < R  # each width decided some, the sort the rest


def test_a_nan_row_is_left_to_the_whole_sort() -> None:
    probs = _rows(2048)[:3].clone()
    probs[1, 5] = math.nan
    k = torch.full((3,), 2048)
    p = torch.full((3,), 0.8, dtype=torch.float64)
    m = torch.zeros(3)
    assert torch.equal(kept_mask(probs, k, p, m), filter_mask._kept_by_sort(probs, k, p, m))
