"""The reduced LM head: a draft model's LM head over a subset of the target's vocabulary."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specd.core.errors import InvalidArgument


class ReducedLMHead(nn.Module):
    """An LM head over a subset of the vocabulary: N rows instead of V.

    Logit row i belongs to target token ``token_map[i]``; every other token
    gets -inf (probability 0), so the full-width output still means "the
    draft's distribution over the target's token space" to any consumer
    (HF generate, CausalLMRunner), while the matmul costs N/V of the full head.
    A ModelDrafter given the same token_map reads only the N columns.
    """

    token_map: Tensor  # a registered buffer (moves with the module)

    def __init__(self, weight: Tensor, token_map: Tensor, vocab_size: int) -> None:
        super().__init__()
        assert weight.dim() == 2 and token_map.shape == weight.shape[:1], (
            f"weight must be [N, H] and token_map [N], got {tuple(weight.shape)} and {tuple(token_map.shape)}"
        )
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)  # [N, H]
        self.register_buffer("token_map", token_map.to(torch.int64).clone())  # [N] target token ids
        self.in_features = int(weight.shape[1])
        self.out_features = int(vocab_size)  # the full width (CausalLMRunner reads it)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., V]
        reduced = nn.functional.linear(hidden, self.weight)  # [..., N]
        out = reduced.new_full((*reduced.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.token_map, reduced)


def check_token_map(token_map: Tensor, vocab_size: int) -> Tensor:
    """token_map as int64 [N], or InvalidArgument: distinct target ids in [0, vocab_size)."""
    if token_map.dim() != 1 or token_map.numel() == 0 or token_map.is_floating_point():
        raise InvalidArgument(f"token_map must be a non-empty 1-D integer tensor, got {tuple(token_map.shape)}")
    token_map = token_map.to(torch.int64)
    if int(token_map.min()) < 0 or int(token_map.max()) >= vocab_size:
        raise InvalidArgument(f"token_map holds ids outside the vocabulary [0, {vocab_size})")
    if int(token_map.unique().numel()) != int(token_map.numel()):
        raise InvalidArgument("token_map holds a token id twice; each draft row must map to its own token")
    return token_map
