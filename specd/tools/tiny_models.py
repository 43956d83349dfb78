"""Tiny test models: randomly initialised Llama and GPT-2 models with a byte-level tokenizer.

Built from configs with random weights in seconds, offline, into folders
that appear atomically (specd.core.model.loading.atomic_folder) and are reused
while their build marker matches. Tests use them everywhere the demo pair's
real text is not needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specd.core.model.loading import atomic_folder, quiet_transformers, read_build_marker

__all__ = [
    "TINY_DRAFT_DIR",
    "TINY_GPT2_DIR",
    "TINY_TARGET_DIR",
    "TINY_TARGET_TP3_DIR",
    "build_tiny_gpt2",
    "build_tiny_pair",
    "build_tiny_target_tp3",
    "build_tiny_tokenizer",
]

TINY_TARGET_DIR = "tiny-target"
TINY_DRAFT_DIR = "tiny-draft"
TINY_GPT2_DIR = "tiny-gpt2"
TINY_TARGET_TP3_DIR = "tiny-target-tp3"
_TINY_RECIPE_VERSION = 1  # bump when the recipe changes: folders built before are rebuilt

# Tiny tokenizer: token id b is byte b (0..255), then the special tokens.
_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_TINY_SPECIALS = (_ENDOFTEXT, _IM_START, _IM_END)  # ids 256, 257, 258
_TINY_VOCAB = 256 + len(_TINY_SPECIALS)
_TINY_CONTEXT = 512
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Weight init std of the tiny models. HF's default (0.02) gives near-uniform
# next-token distributions at hidden size 32-64; 0.2 gives logits with a std
# of ~1.5, so greedy decoding depends on the prompt and sampling is not flat.
_TINY_INIT_STD = 0.2


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0..255 are the bytes, then <|endoftext|>, <|im_start|>, <|im_end|>.

    No merges, so any text round-trips and token id == byte value. Built
    offline with the `tokenizers` library, in milliseconds.
    """
    byte_to_char = bytes_to_unicode()  # the ByteLevel pre-tokenizer's alphabet
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _TINY_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_ENDOFTEXT,
        eos_token=_ENDOFTEXT,
        pad_token=_ENDOFTEXT,
        extra_special_tokens=[_IM_START, _IM_END],
        clean_up_tokenization_spaces=False,  # exact round-trips
        model_max_length=_TINY_CONTEXT,
    )
    tokenizer.chat_template = _CHATML_TEMPLATE
    assert len(tokenizer) == _TINY_VOCAB
    return tokenizer


def _tiny_eot() -> int:
    return 256 + _TINY_SPECIALS.index(_ENDOFTEXT)  # eos, bos and pad, as in GPT-2


def _tiny_llama(*, layers: int, hidden: int, heads: int, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=_TINY_VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=_TINY_CONTEXT,
        initializer_range=_TINY_INIT_STD,
        tie_word_embeddings=False,
        bos_token_id=_tiny_eot(),
        eos_token_id=_tiny_eot(),
        pad_token_id=_tiny_eot(),
    )


def _tiny_gpt2() -> GPT2Config:
    return GPT2Config(
        vocab_size=_TINY_VOCAB,
        n_positions=_TINY_CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=_TINY_INIT_STD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=_tiny_eot(),
        eos_token_id=_tiny_eot(),
        pad_token_id=_tiny_eot(),
    )


def _build_random(final: Path, make: Callable[[], PreTrainedModel], *, seed: int, kind: str) -> Path:
    """Build (or reuse) a randomly initialised model + tiny tokenizer at `final`."""
    marker = {"kind": kind, "seed": seed, "recipe": _TINY_RECIPE_VERSION}
    if read_build_marker(final) == marker:
        return final
    with atomic_folder(final, marker) as tmp:
        # A private RNG stream: deterministic from `seed`, and the caller's
        # global torch RNG state is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make()
        model.eval()
        model.generation_config.update(bos_token_id=_tiny_eot(), eos_token_id=_tiny_eot(), pad_token_id=_tiny_eot())
        with quiet_transformers():
            model.save_pretrained(tmp)
            build_tiny_tokenizer().save_pretrained(tmp)
    return final


def build_tiny_pair(root: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """Two tiny random Llama models sharing one byte-level tokenizer: (target, draft) folders.

    target: 3 layers, hidden 64, 4 heads over 2 KV heads (GQA), 512 positions.
    draft:  1 layer, hidden 32, 2 heads over 1 KV head.
    Built once under `root` (a second call with the same seed reuses them).
    Deterministic from `seed` (the draft uses seed + 1, so the two differ).
    """
    root = Path(root)
    target = _build_random(
        root / TINY_TARGET_DIR,
        lambda: LlamaForCausalLM(_tiny_llama(layers=3, hidden=64, heads=4, kv_heads=2)),
        seed=seed,
        kind="tiny-llama-target",
    )
    draft = _build_random(
        root / TINY_DRAFT_DIR,
        lambda: LlamaForCausalLM(_tiny_llama(layers=1, hidden=32, heads=2, kv_heads=1)),
        seed=seed + 1,
        kind="tiny-llama-draft",
    )
    return target, draft


def build_tiny_target_tp3(root: Path, *, seed: int = 0) -> Path:
    """A tiny random Llama target that shards by 3 (and by 1), with the tiny tokenizer.

    3 layers, hidden 96, 6 heads over 3 KV heads (head size 16, as the pair's target), MLP
    width 192: --tp 3 divides every sharded count (tensor_parallel.check_model_folder), which
    the pair's 4 heads over 2 KV heads do not. Drafts with the pair's draft (same tokenizer).
    """
    return _build_random(
        Path(root) / TINY_TARGET_TP3_DIR,
        lambda: LlamaForCausalLM(_tiny_llama(layers=3, hidden=96, heads=6, kv_heads=3)),
        seed=seed,
        kind="tiny-llama-target-tp3",
    )


def build_tiny_gpt2(root: Path, *, seed: int = 0) -> Path:
    """A tiny random GPT-2 (2 layers, hidden 64, 4 heads, 512 positions) with the tiny tokenizer."""
    return _build_random(Path(root) / TINY_GPT2_DIR, lambda: GPT2LMHeadModel(_tiny_gpt2()), seed=seed, kind="tiny-gpt2")
