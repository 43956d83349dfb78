"""Incremental detokenization with stop strings.

Tokens are decoded with a little context before them, and text is released
only once it is final: a multi-byte character split across tokens shows as
U+FFFD until its last byte arrives, and text that could still become a stop
string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 6  # tokens decoded before the new ones, for merges and leading spaces
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stop_strings: Sequence[str] = ()
    ) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # ids[prefix:read] were decoded into the text already emitted
        self._read = len(self._ids)
        self._stops = [s for s in stop_strings if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # all final text so far (stop string excluded)
        self._emitted = 0  # chars of self.text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        text = self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return cast(str, text)  # one flat list of ids decodes to one string (a batch would give a list)

    def push(self, token_ids: Sequence[int]) -> int | None:
        """Add committed tokens. If a stop string completed, return how many of these tokens to keep."""
        for i, token in enumerate(token_ids):
            self._ids.append(int(token))
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full_text = self._decode(self._ids[self._prefix :])
            if full_text.endswith(_INCOMPLETE) or len(full_text) <= len(prefix_text):
                continue  # wait for the rest of the character (or a token with no text)
            old_len = len(self.text)
            self.text += full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            if self._stops:
                search_from = max(0, old_len - self._holdback)
                hits = [at for s in self._stops if (at := self.text.find(s, search_from)) >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    self.stopped = True
                    return i + 1
        return None

    def take(self, final: bool = False) -> str:
        """Text not handed out yet that can no longer change (all of it when final)."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
