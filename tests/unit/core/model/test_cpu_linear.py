"""Few-row linear layers on CPU: the same products as torch's linear, for every shape a step or a verify has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.core.model.catalog import load_draft_for_serving, load_for_serving
from specd.core.model.cpu_linear import SMALL_ROWS, install_small_row_linears


class Shard(torch.nn.Linear):
    """A subclass with its own forward (as a sharded layer has): left alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (3, 24), (1, 5, 24), (2, 4, 24), (1, SMALL_ROWS + 1, 24), (0, 24)])
def test_same_values_as_torch_linear(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert install_small_row_linears(layer) == 1
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_model_routes_its_plain_linears_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), Shard(8, 4), torch.nn.Linear(4, 3))
    x = torch.randn(1, 8)
    expected = model(x)
    assert install_small_row_linears(model) == 2
    torch.testing.assert_close(model(x), expected)
    assert torch.equal(model(x), torch.zeros(1, 3) + model[3].bias)  # the Shard still zeroes its output


def test_a_model_without_cpu_weights_is_left_alone() -> None:
    assert install_small_row_linears(torch.nn.ReLU()) == 0
    meta = torch.nn.Linear(4, 4, device="meta")
    assert install_small_row_linears(meta) == 0
    assert "forward" not in vars(meta)


def test_installing_twice_is_a_no_op() -> None:
    layer = torch.nn.Linear(4, 4)
    assert install_small_row_linears(layer) == 1
    assert install_small_row_linears(layer) == 0


def test_a_shard_with_fewer_rows_than_out_features() -> None:
    """A tensor-parallel head keeps one shard of rows and states the full width in out_features."""
    layer = torch.nn.Linear(6, 10, bias=False)
    layer.weight = torch.nn.Parameter(layer.weight[:5].detach().clone())  # rank 0 of 2
    install_small_row_linears(layer)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_the_output_is_contiguous_like_torch_linear() -> None:
    layer = torch.nn.Linear(6, 12)
    install_small_row_linears(layer)
    for rows in (1, 2, 5):
        out = layer(torch.randn(1, rows, 6))
        assert out.is_contiguous()
        out.view(1, rows, 3, 4)  # what attention does with a projection's output


@pytest.mark.parametrize("few_row", [True, False])
def test_serving_loads_follow_the_cpu_linear_setting(tiny_pair: tuple[Path, Path], few_row: bool) -> None:
    """--cpu-linear few-row (the default) routes a served model's linears; --cpu-linear torch leaves them."""
    target, draft = tiny_pair
    _, runner = load_for_serving(target, "cpu", few_row_linears=few_row)
    _, draft_runner, _ = load_draft_for_serving(draft, "cpu", few_row_linears=few_row)
    for model in (runner.model, draft_runner.model):
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        assert linears
        assert all(("forward" in vars(m)) == few_row for m in linears)
