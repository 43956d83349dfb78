"""Incremental detokenization with stop strings.

Tokens are decoded with a little context before them, and text is released
only once it is final: a multi-byte character split across tokens shows as
U+FFFD until its last byte arrives, and text that could still become a stop
string is held back. Waiting for a character is bounded (see _undecided), so the
work per token stays flat whatever bytes the tokens carry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_CONTEXT_TOKENS = 6  # tokens decoded before the new ones, for merges and leading spaces
_INCOMPLETE = "\ufffd"
# Waiting re-decodes every pending token on each push: without a bound, a run of tokens that
# never completes a character (lone UTF-8 continuation bytes, skipped special tokens) costs
# quadratic work. Valid text waits at most a few tokens (a character is at most 4 bytes).
_PENDING_LIMIT = 16  # pending tokens before the older ones are settled
_SETTLE_TOKENS = 3  # a token is >= 1 byte, so 3 tokens after a boundary decide the character across it
_PENDING_MAX = 64  # past this, release the undecided text as it stands


def _decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """ids -> text with special tokens skipped and no clean-up of spaces.

    A fast (Rust) tokenizer's decode with clean-up off is exactly its backend's
    decode: call that directly, without transformers' per-call conversions (the
    coordinator decodes on every round's critical path).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(tokenizer, PreTrainedTokenizerFast) and backend is not None:
        return lambda ids: cast(str, backend.decode(ids, skip_special_tokens=True))
    # One flat list of ids decodes to one string (a batch would give a list).
    return lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stop_strings: Sequence[str] = ()
    ) -> None:
        self._decode = _decoder(tokenizer)
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # ids[prefix:read] were decoded into the text already emitted
        self._read = len(self._ids)
        self._stops = [s for s in stop_strings if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # all final text so far (stop string excluded)
        self._emitted = 0  # chars of self.text handed out
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> int | None:
        """Add committed tokens. If a stop string completed, return how many of these tokens to keep.

        A round's tokens are decoded together (two decodes, not two per token)
        when they end on a whole character and complete no stop string, the
        usual case; otherwise one token at a time, to find where the text stops.
        """
        held = len(self._ids)
        self._ids.extend(int(t) for t in token_ids)
        if len(token_ids) > 1:
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full_text = self._decode(self._ids[self._prefix :])
            if not full_text.endswith(_INCOMPLETE) and len(full_text) > len(prefix_text):
                new = full_text[len(prefix_text) :]
                if not self._stops_in(self.text + new, len(self.text)):
                    self.text += new
                    self._prefix, self._read = self._read, len(self._ids)
                    return None
        del self._ids[held:]
        return self._push_each(token_ids)

    def _stops_in(self, text: str, old_len: int) -> list[int]:
        """Where stop strings begin in text, looking from just before old_len (a stop may span the join)."""
        search_from = max(0, old_len - self._holdback)
        return [at for s in self._stops if (at := text.find(s, search_from)) >= 0]

    def _push_each(self, token_ids: Sequence[int]) -> int | None:
        for i, token in enumerate(token_ids):
            self._ids.append(int(token))
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            full_text = self._decode(self._ids[self._prefix :])
            at, text = len(self._ids), full_text
            if full_text.endswith(_INCOMPLETE) or len(full_text) <= len(prefix_text):
                release = self._undecided(prefix_text, full_text)
                if release is None:
                    continue  # wait for the rest of the character (or a token with no text)
                at, text = release
                if len(text) <= len(prefix_text):
                    del self._ids[self._read : at]  # tokens with no text: drop them, keep the context
                    continue
            if self._release(text[len(prefix_text) :], at):
                return i + 1
        return None

    def _release(self, new: str, at: int) -> bool:
        """Make `new` (the text of the tokens up to ids[at]) final; True if it completed a stop string (cut there)."""
        old_len = len(self.text)
        self.text += new
        self._prefix, self._read = self._read, at
        hits = self._stops_in(self.text, old_len)
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return bool(hits)

    def _undecided(self, prefix_text: str, full_text: str) -> tuple[int, str] | None:
        """While the tail is undecided: (token boundary, text up to it) to release now, or None to wait.

        Past _PENDING_LIMIT pending tokens, the text up to _SETTLE_TOKENS before the end is final
        if the full text starts with it (its last character did not change since); past
        _PENDING_MAX (a long run of tokens each splitting a character) everything is released.
        Either bounds the tokens decoded per push.
        """
        pending = len(self._ids) - self._read
        if pending >= _PENDING_MAX:
            return len(self._ids), full_text
        if pending < _PENDING_LIMIT:
            return None
        at = len(self._ids) - _SETTLE_TOKENS
        settled = self._decode(self._ids[self._prefix : at])
        return (at, settled) if full_text.startswith(settled) else None

    def take(self, final: bool = False) -> str:
        """Text not handed out yet that can no longer change (all of it when final).

        Final also releases the tokens still waiting for the rest of a character: their text as
        it decodes (U+FFFD for a character the output ends inside, or a U+FFFD the text holds),
        as the whole output decoded at once would show it.
        """
        if final and not self.stopped and len(self._ids) > self._read:
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self._release(self._decode(self._ids[self._prefix :])[len(prefix_text) :], len(self._ids))
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
