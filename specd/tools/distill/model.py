"""Stage 3, the draft model: the target's architecture with fewer layers, its trainer and the KL loss."""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from specd.core.errors import InvalidArgument
from specd.tools.distill.packing import Packed, make_batch

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel


def layers_key(config) -> str:
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, name):
            return name
    raise InvalidArgument(f"cannot tell how many layers a {type(config).__name__} has")


def draft_config(target_config, layers: int):
    config = copy.deepcopy(target_config)
    n = getattr(target_config, layers_key(target_config))
    if layers > n:
        raise InvalidArgument(f"--layers {layers} is more than the target's {n}")
    setattr(config, layers_key(config), layers)
    for name in ("layer_types",):  # per-layer lists must match the new depth
        value = getattr(config, name, None)
        if isinstance(value, list):
            setattr(config, name, value[:layers])
    return config


def borrowed_names(draft: PreTrainedModel) -> set[str]:
    """Parameter names taken from the target and kept frozen: input embeddings and the output head."""
    params = {id(p): n for n, p in draft.named_parameters(remove_duplicate=False)}
    names: set[str] = set()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        if module is not None and id(module.weight) in params:
            names.update(n for n, p in draft.named_parameters(remove_duplicate=False) if p is module.weight)
    return names


def build_draft(target: PreTrainedModel, layers: int, init: str, seed: int) -> PreTrainedModel:
    """The target's architecture with `layers` layers; embeddings (and head) copied from the target.

    init 'target' also copies the first `layers` layers and every other
    parameter with a matching name and shape (final norm, position embeddings).
    """
    config = draft_config(target.config, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.state_dict()
    own = draft.state_dict()
    borrowed = borrowed_names(draft)
    take = {}
    for name, value in own.items():
        if name in source and source[name].shape == value.shape and (init == "target" or name in borrowed):
            take[name] = source[name].to(torch.float32)
    draft.load_state_dict(take, strict=False)
    return draft


class DraftTrainer(nn.Module):
    """The draft's body plus the (reduced) head used for training: logits over the head's columns."""

    def __init__(self, draft: PreTrainedModel, token_map: Tensor | None, train_head: bool) -> None:
        super().__init__()
        self.draft = draft
        head = draft.get_output_embeddings().weight  # [V, H]
        rows = head.detach()[token_map] if token_map is not None else head.detach()
        self.head = nn.Parameter(rows.clone().float(), requires_grad=train_head)  # [N, H]
        borrowed = borrowed_names(draft)
        for name, p in draft.named_parameters():
            p.requires_grad_(name not in borrowed)

    def trained_state(self) -> dict[str, Tensor]:
        """What a checkpoint needs: the trained parameters (the borrowed ones come from the target)."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}

    def forward(self, x: Tensor) -> Tensor:  # [B, T] -> [B, T, N]
        hidden = self.draft.base_model(input_ids=x, use_cache=False).last_hidden_state  # [B, T, H]
        return nn.functional.linear(hidden, self.head)


def kl_loss(logits: Tensor, cols: Tensor, probs: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked rows of KL(p || q): p the teacher's (restricted) top-k, q = softmax(logits).

    logits [B, T, N]; cols [B, T, k] column per teacher slot (-1: none); probs [B, T, k]; mask [B, T].
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # [B, T, N]
    logq_k = logq.gather(-1, cols.clamp_min(0))  # [B, T, k]
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-30).log(), 0.0)
    kl = (plogp - probs * logq_k).sum(-1)  # [B, T]
    m = mask & (probs.sum(-1) > 0)
    return (kl * m).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def agreement(
    trainer: DraftTrainer,
    packed: Packed,
    token_map: Tensor | None,
    seq_len: int,
    device: torch.device,
    autocast: bool,
) -> tuple[float, float]:
    """(mean KL, top-1 agreement with the teacher) over a packed set."""
    trainer.eval()
    rng = random.Random(0)
    kl_sum = n_sum = agree = 0.0
    for i in range(0, len(packed), 8):
        b = make_batch(packed, range(i, min(i + 8, len(packed))), seq_len, rng)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = trainer(b["x"].to(device))
        m = b["mask"].to(device)
        n = int(m.sum())
        kl_sum += float(kl_loss(logits, b["cols"].to(device), b["probs"].to(device), m)) * n
        pred = logits.argmax(-1)
        pred = token_map.to(device)[pred] if token_map is not None else pred
        agree += float(((pred == b["top"].to(device)) & m).sum())
        n_sum += n
    trainer.train()
    return kl_sum / max(n_sum, 1), agree / max(n_sum, 1)
