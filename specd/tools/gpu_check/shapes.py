"""Model shapes the GPU check measures, and random-weight Llamas of those shapes built on the spot.

Nothing is downloaded: the device machine reaches no registry, and the timing of a forward
depends on the shape and dtype, not on the weights' values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specd.tools.tiny_models import build_tiny_tokenizer

__all__ = ["DEMO_TARGET", "LLAMA_1B", "LLAMA_8B", "Shape", "build_llama", "dry_run_stand_in", "save_random_target"]


@dataclass(frozen=True)
class Shape:
    name: str  # what the summary calls it
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False  # input embeddings shared with the LM head
    context: int = 8192  # max_position_embeddings

    def config(self, *, init_std: float = 0.02) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            tie_word_embeddings=self.tied,
            initializer_range=init_std,
        )


LLAMA_8B = Shape("llama-3.1-8b-shape", 4096, 14336, 32, 32, 8, 128256)  # Llama-3.1-8B
LLAMA_1B = Shape("llama-3.2-1b-shape", 2048, 8192, 16, 32, 8, 128256, tied=True)  # Llama-3.2-1B
DEMO_TARGET = Shape("smollm2-135m-shape", 576, 1536, 30, 9, 3, 49152, tied=True)  # SmolLM2-135M-Instruct

# The same roles at tiny sizes, for `--dry-run` on a CPU in seconds.
_STAND_INS = (
    (LLAMA_8B, Shape("tiny-8b-stand-in", 64, 128, 2, 4, 2, 512, context=1024)),
    (LLAMA_1B, Shape("tiny-1b-stand-in", 32, 64, 2, 4, 2, 512, tied=True, context=1024)),
    (DEMO_TARGET, Shape("tiny-demo-stand-in", 64, 128, 4, 4, 2, 259, tied=True, context=1024)),
)


def dry_run_stand_in(shape: Shape) -> Shape:
    """The tiny shape that plays `shape`'s role in a dry run."""
    return next(tiny for full, tiny in _STAND_INS if full == shape)


def build_llama(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama of `shape`, allocated and initialised on `device` in `dtype`, in eval mode."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype, not cast after (8B: 16 GB, not 32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(shape.config())
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def save_random_target(shape: Shape, folder: Path, seed: int = 0) -> Path:
    """A random-weight Llama of `shape` with the byte-level test tokenizer, saved as an HF folder.

    The target `specd distill` trains against on the device (no download). Its vocabulary is the
    tokenizer's 259 ids; the rest of the shape is `shape`'s. init std 0.2 gives peaked next-token
    distributions (near-uniform ones would leave nothing to learn).
    """
    torch.manual_seed(seed)
    tokenizer = build_tiny_tokenizer()
    config = dataclasses.replace(shape, vocab=len(tokenizer)).config(init_std=0.2)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
