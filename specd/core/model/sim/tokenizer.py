"""A tokenizer for an emulated model: real-size vocabulary, readable output, built offline in a second.

Ids 0..255 are the bytes (so any prompt text encodes, byte by byte), then
<|endoftext|>, <|im_start|>, <|im_end|> (ChatML, so chat requests work),
then synthetic words (" kalo", " mibe", ...) up to the vocabulary size. No
merges: text encodes to bytes only, while the emulated model's outputs
decode to words. Saved once per vocabulary size into the model cache, where
the coordinator and the bench load it like any tokenizer folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specd.core.errors import InvalidArgument

__all__ = ["SPECIALS", "build_sim_tokenizer", "sim_tokenizer_folder"]

_ENDOFTEXT, _IM_START, _IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (_ENDOFTEXT, _IM_START, _IM_END)  # ids 256, 257, 258
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")  # 70 two-letter syllables
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_RECIPE = 1  # bump when the vocabulary recipe changes
_MARKER = "specd-sim-tokenizer.json"


def _word(i: int) -> str:
    """The i-th synthetic word: i in base 70 over two-letter syllables, at least two of them (distinct by construction)."""
    digits = []
    while True:
        i, d = divmod(i, len(_SYLLABLES))
        digits.append(_SYLLABLES[d])
        if i == 0 and len(digits) >= 2:
            break
    return "".join(reversed(digits))


def build_sim_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tokenizer of an emulated model with `vocab_size` tokens (len(tokenizer) == vocab_size)."""
    base = 256 + len(SPECIALS)
    if vocab_size < base:
        raise InvalidArgument(f"an emulated model needs vocab_size >= {base} (bytes + specials), got {vocab_size}")
    byte_to_char = bytes_to_unicode()  # the ByteLevel alphabet; byte 0x20 (space) is "Ġ"
    vocab = {byte_to_char[b]: b for b in range(256)}
    space = byte_to_char[ord(" ")]
    # Specials sit in the model vocabulary at 256..258 (add_special_tokens then finds
    # them there instead of appending new ids); words follow them.
    vocab.update({t: 256 + j for j, t in enumerate(SPECIALS)})
    for i in range(vocab_size - base):
        vocab[space + _word(i)] = base + i
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_ENDOFTEXT,
        eos_token=_ENDOFTEXT,
        pad_token=_ENDOFTEXT,
        extra_special_tokens=[_IM_START, _IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = _CHATML_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIALS))
    if len(tokenizer) != vocab_size or ids != [256, 257, 258]:
        raise AssertionError(f"sim tokenizer: {len(tokenizer)} tokens (expected {vocab_size}), specials at {ids}")
    return tokenizer


def sim_tokenizer_folder(cache_dir: Path, vocab_size: int) -> Path:
    """A tokenizer folder for `vocab_size`, written once into cache_dir (safe against concurrent writers)."""
    final = Path(cache_dir).expanduser() / f"sim-tokenizer-{vocab_size}"
    marker = {"kind": "sim-tokenizer", "vocab_size": vocab_size, "recipe": _RECIPE}
    if _read_marker(final) == marker:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build_sim_tokenizer(vocab_size).save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if final.exists():
            if _read_marker(final) == marker:
                return final  # a concurrent writer finished first
            shutil.rmtree(final)  # an older recipe
        try:
            os.rename(tmp, final)
        except OSError:
            if _read_marker(final) != marker:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None
