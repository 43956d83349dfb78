"""Loading models: Hugging Face folders, and writing model folders atomically.

Everything here works offline: folders are loaded with ``local_files_only``.
Callers pass every path; nothing here reads the environment. The demo target
(specd.core.model.demo_target) and the tiny test models (specd.tools.tiny_models)
are built into folders with `atomic_folder`.

Folders written with `atomic_folder` appear atomically: they are written
under a temporary name next to their final place and renamed, so an
interrupted run never leaves a half folder behind that a later run would
trust. They are readable by every user (files 0644, folders 0755): a
container's non-root user must read the models baked in by root.

Loading is quiet: transformers' load reports and progress bars are turned
off around specd's own loads (`quiet_transformers`), unless specd's logger
is at DEBUG.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specd.core.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

__all__ = [
    "LoadedModel",
    "atomic_folder",
    "check_readable",
    "load_pretrained",
    "quiet_transformers",
    "read_build_marker",
    "share_readable",
    "vocab_fingerprint",
]

log = logging.getLogger(__name__)

# Written last into every folder `atomic_folder` builds; a folder without it (or
# with other build parameters) is rebuilt. Builders bump a recipe version in the marker.
_BUILD_MARKER = "specd-build.json"


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
