"""The default KV budget: on CUDA from the memory free after loading (vLLM-style), elsewhere none unless set.

No GPU here: the CUDA path is the pure arithmetic (kv_budget_from_free_memory, activation_bytes) plus
default_kv_budget over a real runner that reports a CUDA device, fed the free memory a GPU would report.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.core.model.kv_memory import (
    GiB,
    activation_bytes,
    default_kv_budget,
    kv_budget_from_free_memory,
    runner_activation_bytes,
)
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.model.sim.profile import parse_sim_spec
from specd.serving.config import DraftConfig, TargetConfig
from target_service.server import _verifier


class CudaReportingRunner(CausalLMRunner):
    """A real runner (its model stays on the CPU) that says it runs on cuda:0."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


@pytest.fixture(scope="module")
def model(tiny_pair: tuple[Path, Path]):
    return load_pretrained(tiny_pair[0]).model


def test_the_budget_is_the_fraction_of_free_memory_less_activations_halved() -> None:
    # 80 GiB free x 0.9 = 72 GiB; 8 GiB of activations; a step may hold twice the budget: 32 GiB.
    assert kv_budget_from_free_memory(80 * GiB, 0.9, 8 * GiB) == 32 * GiB
    assert kv_budget_from_free_memory(10 * GiB, 1.0, 0) == 5 * GiB
    assert kv_budget_from_free_memory(1000, 0.5, 100) == 200  # (500 - 100) / 2


def test_no_room_for_a_cache_is_an_error_not_an_unlimited_budget() -> None:
    with pytest.raises(FailedPrecondition, match="--max-kv-bytes") as info:
        kv_budget_from_free_memory(4 * GiB, 0.9, 4 * GiB)  # activations take all of it
    assert "--kv-memory-fraction" in str(info.value) and "4.00 GiB are free" in str(info.value)
    for fraction in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(InvalidArgument, match="kv-memory-fraction"):
            kv_budget_from_free_memory(GiB, fraction, 0)


def test_activations_of_the_longest_pass() -> None:
    # Llama-3-8B-like: 8192 tokens, hidden 4096, MLP 14336, bf16; 32 x 9 rows of a 128256 vocabulary.
    got = activation_bytes(tokens=8192, hidden=4096, intermediate=14336, logit_rows=288, vocab=128256, element_size=2)
    assert got == 8192 * (4 * 4096 + 3 * 14336) * 2 + 288 * 128256 * 4 * 3
    assert 1.1 * GiB < got < 1.4 * GiB


def test_a_cuda_runner_gets_its_budget_from_the_memory_free_after_loading(model, caplog) -> None:
    runner = CudaReportingRunner(model)
    reserve = runner_activation_bytes(runner, logit_rows=32 * 33)
    config = model.config
    assert reserve == activation_bytes(
        tokens=runner.max_context,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        logit_rows=32 * 33,
        vocab=runner.vocab_size,
        element_size=4,  # the tiny model is float32
    )
    asked: list[torch.device] = []

    def free_on(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 6 * GiB, 80 * GiB

    with caplog.at_level(logging.INFO, logger="specd.core.model.kv_memory"):
        budget = default_kv_budget(runner, 0, 0.5, logit_rows=32 * 33, mem_get_info=free_on)
    assert asked == [torch.device("cuda", 0)]
    assert budget == (3 * GiB - reserve) // 2
    assert "KV budget" in caplog.text and str(budget) in caplog.text
    # --max-kv-bytes wins, and nothing is measured
    assert default_kv_budget(runner, 12345, 0.5, logit_rows=1, mem_get_info=free_on) == 12345 and len(asked) == 1


def test_cpu_and_emulated_models_keep_no_limit_unless_set(model, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="specd.core.model.kv_memory"):
        assert default_kv_budget(CausalLMRunner(model), 0, 0.9, logit_rows=1) == 0
    assert "KV budget: none on cpu" in caplog.text
    sim = parse_sim_spec("sim:h100-8b").runner("target")
    assert default_kv_budget(sim, 0, 0.9, logit_rows=1) == 0  # an emulated accelerator holds no device memory
    assert default_kv_budget(sim, 4096, 0.9, logit_rows=1) == 4096


def test_the_target_service_builds_its_verifier_with_the_budget(model) -> None:
    runner = CausalLMRunner(model)
    assert _verifier(runner, TargetConfig(max_kv_bytes=1 << 20))._pool.budget.max_bytes == 1 << 20
    assert _verifier(runner, TargetConfig())._pool.budget.max_bytes == 0  # CPU: no limit unless set


@pytest.mark.parametrize("fraction", [0.0, 1.01, -1.0])
def test_the_fraction_setting_is_checked(fraction: float) -> None:
    for config in (TargetConfig, DraftConfig):
        with pytest.raises(InvalidArgument, match="--kv-memory-fraction"):
            config(kv_memory_fraction=fraction).validate()
