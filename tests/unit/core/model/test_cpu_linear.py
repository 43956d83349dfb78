"""Few-row linear layers on CPU: the same products as torch's linear, for every shape a step or a verify has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.core.errors import InvalidArgument
from specd.core.model.catalog import load_draft_for_serving, load_for_serving
from specd.core.model.cpu_linear import (
    CPU_LINEARS,
    FEW_ROW_KERNELS,
    GEMV_ROWS,
    PACK_ROWS_HINT,
    PACKED_GEMV_ROWS,
    few_row_kernel,
    install_small_row_linears,
)


class Shard(torch.nn.Linear):
    """A subclass with its own forward (as a sharded layer has): left alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0


@pytest.mark.parametrize("few_rows", FEW_ROW_KERNELS)
@pytest.mark.parametrize("kind", ["packed", "few-row"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 24),
        (2, 24),
        (3, 24),
        (1, 5, 24),
        (2, 4, 24),
        (1, GEMV_ROWS + 1, 24),
        (1, PACK_ROWS_HINT + 1, 24),
        (3, 40, 24),
        (0, 24),
    ],
)
def test_same_values_as_torch_linear(kind: str, bias: bool, shape: tuple[int, ...], few_rows: str) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert install_small_row_linears(layer, kind, few_rows) == 1
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "vendor, kernel", [("GenuineIntel", "torch"), ("AuthenticAMD", "transposed"), (None, "transposed")]
)
def test_the_few_row_kernel_follows_the_cpu_vendor(tmp_path: Path, vendor: str | None, kernel: str) -> None:
    """MKL's few-row linear is the fast kernel on Intel CPUs and a slow path elsewhere (cpu_linear's docstring)."""
    cpuinfo = tmp_path / "cpuinfo"
    if vendor is not None:  # None: no such file (not Linux)
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx512f\n")
    assert few_row_kernel(cpuinfo) == kernel


def test_an_unknown_few_row_kernel_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="few-row kernel"):
        install_small_row_linears(torch.nn.Linear(4, 4), "packed", "gemv")


def test_the_packed_weight_follows_in_place_changes() -> None:
    """More rows than PACKED_GEMV_ROWS run on a packed copy of the weight; a changed weight is packed again."""
    layer = torch.nn.Linear(16, 32)
    install_small_row_linears(layer)
    x = torch.randn(PACKED_GEMV_ROWS + 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2.0)  # in place: the same storage, a new version
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(32, 16))  # replaced
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_gradients_flow_through_many_rows() -> None:
    """While autograd records (training a draft), many rows take torch's linear, which has a backward."""
    layer = torch.nn.Linear(8, 4)
    install_small_row_linears(layer)
    layer(torch.randn(PACKED_GEMV_ROWS + 5, 8)).sum().backward()
    assert layer.weight.grad is not None
    assert not hasattr(layer, "_specd_packed")


def test_only_packed_makes_a_packed_copy() -> None:
    x = torch.randn(PACKED_GEMV_ROWS + 1, 8)
    for kind in CPU_LINEARS:
        layer = torch.nn.Linear(8, 4)
        install_small_row_linears(layer, kind)
        with torch.no_grad():
            layer(x)
        assert hasattr(layer, "_specd_packed") == (kind == "packed")


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="packed, few-row, torch"):
        install_small_row_linears(torch.nn.Linear(2, 2), "fast")


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
    for rows in (3, 7):  # few rows, and the packed weight
        x = torch.randn(2, rows, 6)
        torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_the_output_is_contiguous_like_torch_linear() -> None:
    layer = torch.nn.Linear(6, 12)
    install_small_row_linears(layer)
    for rows in (1, 2, 5, 12):
        out = layer(torch.randn(1, rows, 6))
        assert out.is_contiguous()
        out.view(1, rows, 3, 4)  # what attention does with a projection's output


@pytest.mark.parametrize("kind", CPU_LINEARS)
def test_serving_loads_follow_the_cpu_linear_setting(tiny_pair: tuple[Path, Path], kind: str) -> None:
    """--cpu-linear packed (the default) or few-row routes a served model's linears; torch leaves them."""
    target, draft = tiny_pair
    _, runner = load_for_serving(target, "cpu", cpu_linear=kind)
    _, draft_runner, _ = load_draft_for_serving(draft, "cpu", cpu_linear=kind)
    for model in (runner.model, draft_runner.model):
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        assert linears
        assert all(("forward" in vars(m)) == (kind != "torch") for m in linears)
        with torch.no_grad():
            model(torch.zeros(1, PACKED_GEMV_ROWS + 1, dtype=torch.long))
        assert any(hasattr(m, "_specd_packed") for m in linears) == (kind == "packed")
