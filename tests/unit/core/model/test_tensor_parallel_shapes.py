"""Tensor-parallel sharding rules without any process: refused shapes, 1/N of the weights per rank, `specd up` flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specd.core.errors import InvalidArgument
from specd.core.model import tensor_parallel
from specd.core.model.loading import load_pretrained
from specd.tools import cli

SMOLLM2_LIKE = dict(  # the demo target's shape (SmolLM2-135M), built on the meta device
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def test_head_counts_that_tp_does_not_divide_are_refused_by_name() -> None:
    config = LlamaConfig(**SMOLLM2_LIKE)
    with pytest.raises(InvalidArgument) as info:
        tensor_parallel.check_config(config, 2)
    message = str(info.value)
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "--tp 1 or 3" in message
    tensor_parallel.check_config(config, 3)  # 9 heads, 3 KV heads, 1536: all divisible


def test_gpt2_is_refused_with_a_clear_error(tiny_gpt2_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"GPT-2|gpt2") as info:
        tensor_parallel.check_model_folder(str(tiny_gpt2_dir), 2)
    assert "c_attn" in str(info.value) and "--tp 1" in str(info.value)


@pytest.mark.parametrize("shape, tp", [("tiny", 2), ("smollm2", 3)])
def test_each_rank_holds_one_nth_of_the_sharded_weights(tiny_pair: tuple[Path, Path], shape: str, tp: int) -> None:
    config = load_pretrained(tiny_pair[0]).model.config if shape == "tiny" else LlamaConfig(**SMOLLM2_LIKE)

    def skeleton() -> torch.nn.Module:
        with torch.device("meta"):  # shapes only: measuring needs no weights
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()
        return model

    full = tensor_parallel.shardable_bytes(skeleton())
    per_rank = []
    for rank in range(tp):
        sharded, replicated = tensor_parallel.weight_bytes(tensor_parallel.shard_model(skeleton(), rank, tp))
        per_rank.append(sharded)
        print(
            f"{shape} tp={tp} rank {rank}: {sharded} B sharded ({sharded / full:.4f} of {full} B), {replicated} B replicated"
        )
    for sharded in per_rank:
        # 1/N exactly, plus at most the zero rows padding the vocabulary to a multiple of N
        assert full / tp <= sharded <= full / tp * 1.01


def test_specd_up_passes_tp_flags_to_the_target() -> None:
    args = cli.build_parser().parse_args(["up", "--tp", "3", "--executor", "ray", "--ray-address", "head:6379"])
    assert cli._tp_args(args) == ["--tp", "3", "--executor", "ray", "--ray-address", "head:6379"]
    assert cli._tp_args(cli.build_parser().parse_args(["up"])) == ["--tp", "1", "--executor", "mp"]
