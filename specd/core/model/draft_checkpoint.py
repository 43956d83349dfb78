"""The draft checkpoint format: what `specd distill` writes and what serving a draft reads.

Two forms of a trained draft:

- A model folder: an ordinary Hugging Face folder, plus REDUCED_HEAD_FILE when
  the draft has a reduced-vocabulary head (token_map [N] int64, and the head
  rows weight [N, H] float32 when they were trained; otherwise the rows are
  the folder's own output embedding rows at token_map).
- The compact form (what specd ships, e.g. specd/assets/demo-draft): only
  what cannot be rebuilt from the target. COMPACT_WEIGHTS holds the trained
  tensors in float16 plus TOKEN_MAP_KEY (int32) and HEAD_KEY (float16) when
  present; COMPACT_META (JSON) holds the model config, the names of the
  tensors borrowed from the target, and the target's tokenizer fingerprint.
  `assemble` rebuilds the model folder from it and the target.

The trainer (specd.tools.distill) and the catalog both import this module;
it imports nothing from the tools.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from specd.core.errors import FailedPrecondition
from specd.core.model.loading import atomic_folder, load_pretrained, read_build_marker, vocab_fingerprint
from specd.core.model.reduced_head import ReducedLMHead, check_token_map

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

__all__ = [
    "COMPACT_META",
    "COMPACT_WEIGHTS",
    "HEAD_KEY",
    "REDUCED_HEAD_FILE",
    "TOKEN_MAP_KEY",
    "assemble",
    "install_reduced_head",
    "target_fingerprint",
    "write_compact",
    "write_reduced_head",
]

REDUCED_HEAD_FILE = "reduced-head.safetensors"  # token_map [N] (and head rows [N, H] if trained)
COMPACT_WEIGHTS = "draft-weights.safetensors"
COMPACT_META = "draft.json"
TOKEN_MAP_KEY = "specd.token_map"  # in COMPACT_WEIGHTS
HEAD_KEY = "specd.head"  # in COMPACT_WEIGHTS, when the head rows were trained
_ASSEMBLY_RECIPE = 1  # bump when `assemble` writes a different folder from the same inputs


def target_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """The tokenizer a draft was trained with, as stored in COMPACT_META: tokenizer_size and vocab_hash."""
    size, digest = vocab_fingerprint(tokenizer)
    return {"tokenizer_size": size, "vocab_hash": digest}


def write_reduced_head(folder: Path, token_map: Tensor, weight: Tensor | None) -> None:
    """REDUCED_HEAD_FILE in a model folder: token_map [N] and, if trained, the head rows [N, H]."""
    tensors = {"token_map": token_map.to(torch.int64).contiguous()}
    if weight is not None:
        tensors["weight"] = weight.detach().to(torch.float32).contiguous()
    save_file(tensors, str(Path(folder) / REDUCED_HEAD_FILE))


def write_compact(
    dest: Path,
    weights: Mapping[str, Tensor],
    token_map: Tensor | None,
    head: Tensor | None,
    meta: Mapping[str, Any],
) -> int:
    """The compact form in `dest`: trained `weights` (float16), token map, head rows, `meta`. Returns bytes written.

    meta must carry "config" (the draft's config dict) and "borrowed" (names
    of the tensors `assemble` takes from the target), besides the target's
    fingerprint (`target_fingerprint`).
    """
    tensors = {n: w.detach().to(torch.float16).contiguous() for n, w in weights.items()}
    if token_map is not None:
        tensors[TOKEN_MAP_KEY] = token_map.to(torch.int32).contiguous()
    if head is not None:
        tensors[HEAD_KEY] = head.detach().to(torch.float16).contiguous()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / COMPACT_WEIGHTS))
    (dest / COMPACT_META).write_text(json.dumps(dict(meta), indent=1, sort_keys=True) + "\n")
    return sum(f.stat().st_size for f in dest.iterdir() if f.is_file())


def assemble(compact: Path, target_folder: Path, dest: Path) -> Path:
    """Rebuild a loadable draft folder from its compact form and the target it was trained for.

    Checks that the target has the tokenizer the draft was trained with.
    Writes atomically (a half-built folder is never left at `dest`).
    """
    compact, target_folder, dest = Path(compact), Path(target_folder), Path(dest)
    meta_file, weights_file = compact / COMPACT_META, compact / COMPACT_WEIGHTS
    if not meta_file.is_file() or not weights_file.is_file():
        raise FailedPrecondition(
            f"{compact} does not hold a compact draft ({COMPACT_META} and {COMPACT_WEIGHTS}); "
            "train one with `specd distill` or reinstall specd"
        )
    meta = json.loads(meta_file.read_text())
    marker = {
        "kind": "assembled-draft",
        "weights_sha256": hashlib.sha256(weights_file.read_bytes()).hexdigest(),
        "target": str(target_folder.resolve()),
        "recipe": _ASSEMBLY_RECIPE,
    }
    if read_build_marker(dest) == marker:
        return dest
    log.info("assembling the draft %s from %s and the target %s (once)", dest, compact, target_folder)
    target = load_pretrained(target_folder)
    found = target_fingerprint(target.tokenizer)
    wanted = {k: meta.get(k) for k in ("tokenizer_size", "vocab_hash")}
    if found != wanted:
        raise FailedPrecondition(
            f"the draft in {compact} was trained for a target with tokenizer {wanted}, but {target_folder} has "
            f"{found}; train a draft for this target with `specd distill`"
        )
    draft = AutoModelForCausalLM.from_config(AutoConfig.for_model(**meta["config"]), dtype=torch.float32)
    tensors = load_file(str(weights_file))
    token_map = tensors.pop(TOKEN_MAP_KEY, None)
    head = tensors.pop(HEAD_KEY, None)
    state = {n: v.to(torch.float32) for n, v in tensors.items()}
    source = target.model.state_dict()
    for name in meta["borrowed"]:
        state[name] = source[name].to(torch.float32)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not _is_tied_alias(draft, m, state)]
    if missing or unexpected:
        raise FailedPrecondition(
            f"the compact draft does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    with atomic_folder(dest, marker) as tmp:
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        if token_map is not None:
            write_reduced_head(tmp, token_map, head)
    return dest


def _is_tied_alias(model: PreTrainedModel, name: str, state: Mapping[str, Tensor]) -> bool:
    """A missing key that is the tied twin of a loaded one (lm_head.weight of a tied model)."""
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return (
        out is not None
        and inp is not None
        and out.weight is inp.weight
        and name.endswith("weight")
        and any(k.endswith("embed_tokens.weight") or k.endswith("wte.weight") for k in state)
    )


def install_reduced_head(model: PreTrainedModel, folder: Path) -> Tensor | None:
    """If `folder` has a reduced head, swap the model's LM head for it; return its token map [N] (else None)."""
    path = Path(folder) / REDUCED_HEAD_FILE
    if not path.is_file():
        return None
    tensors = load_file(str(path))
    full = model.get_output_embeddings()
    vocab = int(getattr(full, "out_features", None) or full.weight.shape[0])
    token_map = check_token_map(tensors["token_map"], vocab)
    weight = tensors.get("weight")
    if weight is None:
        weight = full.weight.detach()[token_map.to(full.weight.device)]
    head = ReducedLMHead(weight.to(full.weight.dtype), token_map, vocab).to(full.weight.device)
    model.set_output_embeddings(head)
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # the head is its own module now
    return token_map
