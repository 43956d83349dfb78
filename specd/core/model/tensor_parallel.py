"""Megatron-style tensor parallelism applied to a plainly loaded causal LM (gpt-fast ``tp.py`` style).

The model is loaded as usual (one full copy), then `shard_model` keeps this
rank's slice of every sharded weight and registers the collectives. The
model code is not edited and knows nothing of it: Llama-family attention
reshapes with ``view(..., -1, head_dim)``, so fewer local heads just work.

Per decoder layer, N ranks, rank r (x: [T, D] activations, replicated):

    attention  q_proj, k_proj, v_proj   column split by heads: rank r keeps heads
                                        [r H/N, (r+1) H/N) (and KV heads [r G/N, (r+1) G/N));
                                        GQA groups stay whole because H/N : G/N = H : G
               o_proj                   row split over the same heads; partial [T, D]
                                        outputs summed by one all-reduce
    MLP        gate_proj, up_proj       column split by intermediate rows
               down_proj                row split; one all-reduce
    KV cache   follows the heads: each rank caches its own G/N KV heads

Embeddings and LM head are **split by vocabulary** (not replicated):

    embed_tokens  rank r holds rows [r Vp, (r+1) Vp), Vp = ceil(V/N); ids outside
                  its range read zeros; one all-reduce of [T, D] (a sum of one
                  value and zeros: exact)
    lm_head       rank r computes logits of its Vp rows; an all-gather builds [T, V]
                  (T = the positions the runner asks for, K+1 when verifying)

Why split them: for the demo target (SmolLM2-135M, tied embedding/head) the
vocabulary matrix is 28.3M of 134.5M parameters (21%) and the head costs as
much compute per token as ~7 of its 30 layers. Replicated, every rank would
keep that 21% and repeat that work; split, each rank holds ~1/N of every
sharded weight, tied weights stay tied (embedding and head shard the same
rows), and the price is one small all-reduce and one all-gather of K+1
logit rows per forward. Norms and rotary tables are replicated (tiny).

Exactness: column-split and vocabulary-split results are exact slices of
the single-device result; only the two row-split all-reduces per layer sum
N partial dot products in a different order (float32 rounding, ~1e-7).

Refused with InvalidArgument (checked from the config and the module tree
alone, before any weight is loaded): head or KV-head or intermediate counts
that N does not divide (the message names them and the tp values that
work), and architectures without separate q/k/v/o and gate/up/down
projections in every layer, e.g. GPT-2 (fused ``c_attn``).

Collectives run on the default torch.distributed group (or the one passed):
gloo on CPU, NCCL on GPU, the same code.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from specd.core.errors import InvalidArgument

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ShardPlan",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "check_config",
    "check_model_folder",
    "plan_sharding",
    "shard_model",
    "shardable_bytes",
    "weight_bytes",
]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_TP_ATTR = "_specd_tp"  # set on every sharded parameter: "column" | "row" | "vocab"


@dataclass(frozen=True)
class ShardPlan:
    """Where the sharded modules are, found by name in the module tree."""

    attention: tuple[str, ...]  # module paths holding q/k/v/o_proj
    mlp: tuple[str, ...]  # module paths holding gate/up/down_proj
    embedding: str  # path of the input embedding
    head: str  # path of the LM head
    tied: bool  # head and embedding share one weight


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config(decoder=True)


def _divisors_of_all(*counts: int) -> list[int]:
    g = 0
    for c in counts:
        g = math.gcd(g, c)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_config(config: PretrainedConfig, tp: int) -> None:
    """InvalidArgument unless `tp` divides the heads, KV heads and MLP width of `config`."""
    if tp < 1:
        raise InvalidArgument(f"tp must be >= 1 (got {tp})")
    c = _text_config(config)
    model_type = getattr(c, "model_type", "?")
    heads = getattr(c, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise InvalidArgument(
            f"tensor parallelism needs a Llama-style config (num_attention_heads); "
            f"model_type {model_type!r} has none; serve it with --tp 1"
        )
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    inter = getattr(c, "intermediate_size", None)
    counts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if isinstance(inter, int):
        counts["intermediate_size"] = inter
    bad = [f"{name}={n}" for name, n in counts.items() if n % tp]
    if bad:
        ok = _divisors_of_all(*counts.values())
        stated = ", ".join(f"{name}={n}" for name, n in counts.items())
        raise InvalidArgument(
            f"--tp {tp} does not divide {' and '.join(bad)} of this {model_type} model ({stated}); "
            f"each rank must hold whole heads: use --tp {' or '.join(map(str, ok))}"
        )


def plan_sharding(model: PreTrainedModel, config: PretrainedConfig) -> ShardPlan:
    """Find the modules to shard; InvalidArgument if the architecture is not Llama-shaped."""
    c = _text_config(config)
    attention, mlp = [], []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if all(isinstance(children.get(n), nn.Linear) for n in _ATTN):
            attention.append(name)
        if all(isinstance(children.get(n), nn.Linear) for n in _MLP):
            mlp.append(name)
    layers = getattr(c, "num_hidden_layers", None)
    model_type = getattr(c, "model_type", "?")
    if not attention or len(attention) != layers or len(mlp) != layers:
        fused = any(n.endswith("c_attn") for n, _ in model.named_modules())
        why = (
            "its attention projects q, k and v with one fused matrix (c_attn)"
            if fused
            else (
                f"found {len(attention)} attention and {len(mlp)} MLP blocks with separate "
                f"q/k/v/o_proj and gate/up/down_proj nn.Linear layers, for {layers} layers"
            )
        )
        raise InvalidArgument(
            f"tensor parallelism supports Llama-family models (Llama, Mistral, Qwen2, SmolLM, ...); "
            f"model_type {model_type!r} cannot be sharded: {why}. Serve it with --tp 1"
        )
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
        raise InvalidArgument(
            f"tensor parallelism needs an nn.Embedding input embedding and an nn.Linear LM head; "
            f"model_type {model_type!r} has {type(emb).__name__} and {type(head).__name__}; serve it with --tp 1"
        )
    names = {id(m): n for n, m in model.named_modules()}
    return ShardPlan(
        attention=tuple(attention),
        mlp=tuple(mlp),
        embedding=names[id(emb)],
        head=names[id(head)],
        tied=head.weight is emb.weight,
    )


def check_model_folder(folder: str, tp: int) -> PretrainedConfig:
    """Validate `tp` against a model folder without loading weights (meta-device module tree)."""
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    check_config(config, tp)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    plan_sharding(skeleton, config)
    return config


# ---- sharded modules ------------------------------------------------------------


def _mark(p: nn.Parameter, kind: str) -> nn.Parameter:
    setattr(p, _TP_ATTR, kind)
    return p


def _rows(t: Tensor, rank: int, world: int) -> Tensor:
    """Rank's equal slice of dim 0 (caller checked divisibility)."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n].clone()


def _vocab_rows(weight: Tensor, rank: int, world: int) -> Tensor:
    """Rows [r Vp, (r+1) Vp) of a [V, D] matrix, zero-padded to Vp rows."""
    v = weight.shape[0]
    vp = -(-v // world)
    part = weight[rank * vp : min((rank + 1) * vp, v)]
    out = torch.zeros((vp, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    out[: part.shape[0]] = part
    return out


class VocabParallelEmbedding(nn.Module):
    """Rank r's rows [start, start + Vp) of the embedding; the full lookup is an all-reduce."""

    def __init__(self, weight: nn.Parameter, start: int, vocab_size: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = weight  # [Vp, D]
        self.start = start
        self.num_embeddings = vocab_size  # the full vocabulary, as nn.Embedding reports it
        self.embedding_dim = weight.shape[1]
        self.group = group

    def forward(self, input_ids: Tensor) -> Tensor:  # [B, T] -> [B, T, D]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [B, T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.group)  # exactly one rank contributes each row
        return out


class VocabParallelLMHead(nn.Module):
    """Rank r's Vp rows of the LM head; logits of all ranks gathered to [..., V]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = weight  # [Vp, D]
        self.out_features = vocab_size  # the full vocabulary (CausalLMRunner reads the width here)
        self.in_features = weight.shape[1]
        self.world = world
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor:  # [B, T, D] -> [B, T, V]
        local = F.linear(hidden, self.weight).contiguous()  # [B, T, Vp]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.out_features]


def _column(linear: nn.Linear, rank: int, world: int) -> None:
    linear.weight = _mark(nn.Parameter(_rows(linear.weight.data, rank, world), requires_grad=False), "column")
    if linear.bias is not None:
        linear.bias = _mark(nn.Parameter(_rows(linear.bias.data, rank, world), requires_grad=False), "column")
    linear.out_features = linear.weight.shape[0]


def _row(linear: nn.Linear, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
    w = linear.weight.data  # [out, in]: keep the input columns of this rank
    linear.weight = _mark(nn.Parameter(_rows(w.t(), rank, world).t().contiguous(), requires_grad=False), "row")
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and rank != 0:
        linear.register_parameter("bias", None)  # added once (by rank 0) before the sum

    def all_reduce(_module: nn.Module, _inputs: object, output: Tensor) -> Tensor:
        dist.all_reduce(output, group=group)  # sum of the ranks' partial products: [B, T, D]
        return output

    linear.register_forward_hook(all_reduce)


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _linear(parent: nn.Module, name: str) -> nn.Linear:
    linear = parent.get_submodule(name)
    assert isinstance(linear, nn.Linear)  # plan_sharding found every projection to be one
    return linear


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(_get(model, parent), leaf, module)


@torch.no_grad()
def shard_model(
    model: PreTrainedModel, rank: int, world: int, group: dist.ProcessGroup | None = None
) -> PreTrainedModel:
    """Keep rank `rank`'s shard of `model` (in place) and register its collectives; returns it.

    The process group is only used when the model runs, so a model can be
    sharded (and measured) before the group exists.
    """
    if not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} is outside [0, {world})")
    check_config(model.config, world)
    plan = plan_sharding(model, model.config)
    if world == 1:
        return model
    for path in plan.attention:
        attn = _get(model, path)
        for name in ("q_proj", "k_proj", "v_proj"):
            _column(_linear(attn, name), rank, world)
        _row(_linear(attn, "o_proj"), rank, world, group)
    for path in plan.mlp:
        mlp = _get(model, path)
        _column(_linear(mlp, "gate_proj"), rank, world)
        _column(_linear(mlp, "up_proj"), rank, world)
        _row(_linear(mlp, "down_proj"), rank, world, group)

    emb = _get(model, plan.embedding)
    head = _get(model, plan.head)
    assert isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear)
    vocab = emb.weight.shape[0]
    vp = -(-vocab // world)
    emb_w = _mark(nn.Parameter(_vocab_rows(emb.weight.data, rank, world), requires_grad=False), "vocab")
    if head.bias is not None:
        raise InvalidArgument("tensor parallelism does not support an LM head with a bias; serve with --tp 1")
    head_vocab = head.weight.shape[0]
    if plan.tied:
        head_w = emb_w  # one shard, still tied
    else:
        head_w = _mark(nn.Parameter(_vocab_rows(head.weight.data, rank, world), requires_grad=False), "vocab")
    _set(model, plan.embedding, VocabParallelEmbedding(emb_w, rank * vp, vocab, group))
    _set(model, plan.head, VocabParallelLMHead(head_w, head_vocab, world, group))
    return model


def _parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of sharded parameters, bytes of replicated parameters) held by this rank.

    A parameter counts once even when tied. On an unsharded model, the first
    number is 0 and everything is "replicated"; use `sharded_names` to compare.
    """
    sharded = replicated = 0
    for p in _parameters(model):
        size = p.numel() * p.element_size()
        if getattr(p, _TP_ATTR, None):
            sharded += size
        else:
            replicated += size
    return sharded, replicated


def shardable_bytes(model: PreTrainedModel) -> int:
    """Bytes of the parameters `shard_model` would split, in an unsharded model."""
    plan = plan_sharding(model, model.config)
    params: dict[int, Tensor] = {}
    for path in plan.attention:
        for name in _ATTN:
            for p in _get(model, f"{path}.{name}" if path else name).parameters():
                params[id(p)] = p
    for path in plan.mlp:
        for name in _MLP:
            for p in _get(model, f"{path}.{name}" if path else name).parameters():
                params[id(p)] = p
    for path in (plan.embedding, plan.head):
        weight = _get(model, path).weight
        assert isinstance(weight, Tensor)  # an Embedding's or a Linear's weight
        params[id(weight)] = weight
    return sum(p.numel() * p.element_size() for p in params.values())
