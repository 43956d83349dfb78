"""What the sampler's and the rejection sampler's table-driven tests share: dtypes and tensors built from tables."""

from __future__ import annotations

import torch

from specd.core.sampling.sampler import SamplingParams, processed_probs
from tests.devices import DEVICE

F32 = torch.float32
F64 = torch.float64
I64 = torch.int64


def logits_of(probs: list[float]) -> torch.Tensor:
    """[1, 1, V] logits whose softmax is `probs` (zero -> -inf)."""
    return torch.tensor(probs, dtype=F64).log().to(DEVICE, F32)[None, None, :]


def processed_row(probs: list[float], **kw) -> torch.Tensor:
    """processed_probs of one row given as target probabilities -> [V]."""
    return processed_probs(logits_of(probs), [SamplingParams(**kw)])[0, 0]


def on_device(x, dtype=I64) -> torch.Tensor:
    """On SPECD_TEST_DEVICE, as are the other inputs of the `device`-marked tests."""
    return torch.tensor(x, dtype=dtype, device=DEVICE)
