"""A causal LM with one KV cache per sequence that can be rolled back by position.

Speculative decoding appends tokens that may later be rejected, so both the
draft and the target need a cache they can cut back to any earlier length.
`CausalLMRunner` wraps a Hugging Face causal LM (Llama family, GPT-2 family,
anything that takes a cache / ``position_ids=`` / ``logits_to_keep=``) and
keeps, per sequence, a `KVSession`: the tokens the owner knows about and the
KV cache of a prefix of them. The cache is filled lazily: `append` and
`truncate` only edit token lists and crop; the model runs in `logits`, over
the tokens that are not cached yet.

Invariant of a session ``s``:
    1 <= len(s.tokens) <= max_context
    0 <= s.cached <= len(s.tokens)
    s.cache holds exactly the keys/values of s.tokens[:s.cached] (every layer)

transformers versions differ in two things this module uses (both read off
the model, see `_cache_argument` and `_takes_row_mask`): the forward's cache
argument is ``cache=`` in 5.24 and ``past_key_values=`` in 5.17 (5.17 takes
``cache=`` into **kwargs and silently runs without the session's cache), and
only 5.24 takes a 2D boolean ``logits_to_keep`` (5.17 indexes dimension 1
with it and fails).
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specd.core.errors import InvalidArgument
from specd.core.model import tree_forward
from specd.core.model.cpu_linear import CPU_LINEARS, install_small_row_linears
from specd.core.model.tree_forward import TreeLogits
from specd.core.sampling.tree import DraftTree

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

__all__ = ["CausalLMRunner", "KVSession"]


@dataclass(eq=False)
class KVSession:
    """One sequence: its tokens and the KV cache of a prefix of them."""

    tokens: list[int]  # all tokens of the sequence as the owner knows it
    cached: int = 0  # the first `cached` tokens are in `cache`
    # A plain DynamicCache (no config): every layer keeps full keys/values and
    # can be cropped exactly. A config-built cache may use sliding-window
    # layers, which drop old positions and cannot be rolled back.
    cache: DynamicCache = field(default_factory=DynamicCache)

    def __len__(self) -> int:
        return len(self.tokens)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The layers of a plain DynamicCache: all DynamicLayer (transformers types them as any layer kind)."""
    return cast(list[DynamicLayer], cache.layers)


def _kv(layer: DynamicLayer) -> tuple[Tensor, Tensor]:
    """(keys, values) of a layer that holds cached positions, each [B, H, T, D]."""
    assert layer.keys is not None and layer.values is not None  # set by the first update
    return layer.keys, layer.values


def _context_limit(model: PreTrainedModel) -> int | None:
    """The model's own position limit, if its config states one."""
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _cache_argument(model: PreTrainedModel) -> str:
    """The forward's keyword for the KV cache: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _takes_row_mask(model: PreTrainedModel) -> bool:
    """Does the model's LM head take a 2D boolean ``logits_to_keep`` (rows of several sequences)?

    transformers 5.24's modeling code slices with ``slice_logits_to_keep``, which does; 5.17's
    ``hidden_states[:, logits_to_keep]`` does not.
    """
    module = sys.modules.get(type(model).__module__)
    return module is not None and hasattr(module, "slice_logits_to_keep")


class CausalLMRunner:
    """Runs a causal LM over `KVSession`s: append, roll back, read logits.

    `logits` runs one session per forward; `logits_batch` runs many sessions
    through one forward. Not thread-safe: callers serialise access.
    """

    def __init__(
        self, model: PreTrainedModel, *, max_context: int | None = None, cpu_linear: str = CPU_LINEARS[0]
    ) -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            raise InvalidArgument(
                f"{type(model).__name__} is an encoder-decoder model; specd needs a decoder-only causal LM"
            )
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise InvalidArgument(f"{type(model).__name__} has no LM head; load it with AutoModelForCausalLM")
        limit = _context_limit(model)
        if max_context is None:
            if limit is None:
                raise InvalidArgument(
                    "the model config states no max_position_embeddings / n_positions; pass max_context"
                )
            max_context = limit
        if max_context < 1:
            raise InvalidArgument(f"max_context must be >= 1, got {max_context}")
        if limit is not None and max_context > limit:
            raise InvalidArgument(
                f"max_context {max_context} exceeds the model's {limit} positions; pass max_context <= {limit}"
            )
        self.model = model.eval()  # no dropout: cached and uncached passes must agree
        # On CPU: steps and verifies of a few rows stream the weights once (specd.core.model.cpu_linear).
        install_small_row_linears(model, cpu_linear)
        # Logits width; may exceed len(tokenizer). A tensor-parallel head states
        # the full width in out_features (its weight holds one shard).
        self.vocab_size: int = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.max_context: int = int(max_context)
        self._kv_bytes_per_token: int | None = None
        self._cache_kw = _cache_argument(model)
        self._row_mask = _takes_row_mask(model)

    # ---- validation -----------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int], what: str) -> list[int]:
        """Token ids as a list of ints in [0, vocab_size), or InvalidArgument."""
        if isinstance(token_ids, (str, bytes)):
            raise InvalidArgument(f"{what} must be a sequence of token ids (ints), not text")
        ids: list[int] = []
        for i, t in enumerate(token_ids):
            if isinstance(t, bool):
                raise InvalidArgument(f"{what}[{i}] is a bool ({t}); token ids must be ints")
            try:
                v = operator.index(t)
            except TypeError:
                raise InvalidArgument(f"{what}[{i}] is {type(t).__name__} {t!r}; token ids must be ints") from None
            if not 0 <= v < self.vocab_size:
                raise InvalidArgument(
                    f"{what}[{i}] = {v} is outside the vocabulary [0, {self.vocab_size}); "
                    "use token ids from this model's tokenizer"
                )
            ids.append(v)
        return ids

    def _check_length(self, n: int, what: str) -> None:
        if n > self.max_context:
            raise InvalidArgument(
                f"{what} would be {n} tokens, more than the context of {self.max_context}; "
                f"shorten it by {n - self.max_context} tokens"
            )

    # ---- session edits (no forward pass) --------------------------------

    def new_session(self, token_ids: Sequence[int]) -> KVSession:
        """A session over `token_ids`; nothing is computed until `logits`."""
        ids = self._check_ids(token_ids, "token_ids")
        if not ids:
            raise InvalidArgument("token_ids is empty; a session needs at least one token (e.g. BOS)")
        self._check_length(len(ids), "the sequence")
        return KVSession(tokens=ids)

    def append(self, s: KVSession, token_ids: Sequence[int]) -> None:
        """Add tokens at the end (e.g. a sampled token, or K draft tokens)."""
        ids = self._check_ids(token_ids, "token_ids")
        self._check_length(len(s.tokens) + len(ids), "the sequence")
        s.tokens.extend(ids)

    def truncate(self, s: KVSession, length: int) -> None:
        """Roll back to the first `length` tokens (1 <= length <= len(s.tokens))."""
        if isinstance(length, bool) or not isinstance(length, int):
            raise InvalidArgument(f"length must be an int, got {type(length).__name__}")
        if not 1 <= length <= len(s.tokens):
            raise InvalidArgument(
                f"cannot truncate a {len(s.tokens)}-token sequence to {length}; length must be in [1, {len(s.tokens)}]"
            )
        del s.tokens[length:]
        self._crop(s, min(s.cached, length))

    def splice(self, s: KVSession, start: int, tail: Sequence[int]) -> None:
        """Make ``s.tokens == s.tokens[:start] + tail``, keeping the cache of the common prefix.

        What a round does to a session: keep what the peer agreed on, replace the rest.
        Only `tail` is checked and compared, so a round costs O(len(tail)), not O(sequence).
        """
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(s.tokens):
            raise InvalidArgument(f"start must be an int in [0, {len(s.tokens)}] (the sequence length), got {start!r}")
        ids = self._check_ids(tail, "token_ids")
        n = start + len(ids)
        if n == 0:
            raise InvalidArgument("token_ids is empty; a session needs at least one token")
        self._check_length(n, "the sequence")
        common = start
        for a, b in zip(s.tokens[start : start + len(ids)], ids):
            if a != b:
                break
            common += 1
        del s.tokens[start:]
        s.tokens.extend(ids)
        self._crop(s, min(s.cached, common))

    def fork(self, s: KVSession) -> KVSession:
        """A second session with s's tokens and cache, sharing the cache tensors (no copy).

        Sharing is safe because nothing writes a cache tensor in place: a crop
        slices (DynamicLayer.crop: a view) and a forward concatenates
        (DynamicLayer.update: a new tensor), so editing either session leaves
        the other's keys and values as they were (tests/unit/core/model/test_runner.py checks
        this against transformers' DynamicLayer). The fork's first forward
        gives it tensors of its own; until then it costs no memory.
        """
        cache = DynamicCache()
        for layer in s.cache.layers:
            if type(layer) is not DynamicLayer:
                raise InvalidArgument(f"cannot fork a {type(layer).__name__} cache; sessions use DynamicLayer")
            twin = DynamicLayer()
            if layer.is_initialized and layer.keys is not None and layer.values is not None:
                twin.lazy_initialization(layer.keys, layer.values)
                twin.keys, twin.values = layer.keys, layer.values
            cache.layers.append(twin)
        return KVSession(tokens=list(s.tokens), cached=s.cached, cache=cache)

    # ---- forward ---------------------------------------------------------

    @torch.inference_mode()
    def logits(self, s: KVSession, num_last: int = 1) -> Tensor:
        """Logits of the last `num_last` positions -> [num_last, V] float32 (model device).

        Row i is the distribution of the token after ``tokens[len - num_last + i]``;
        the last row predicts the next token. Verifying K draft tokens is
        ``append(s, drafts); logits(s, K + 1)``.
        """
        n = len(s.tokens)
        if isinstance(num_last, bool) or not isinstance(num_last, int) or not 1 <= num_last <= n:
            raise InvalidArgument(f"num_last must be an int in [1, {n}] (the sequence length), got {num_last!r}")
        # Positions [start, n) must run through the model to produce num_last rows;
        # if fewer are uncached, drop their keys/values and recompute them.
        start = min(s.cached, n - num_last)
        self._crop(s, start)

        device = self.model.device
        input_ids = torch.tensor([s.tokens[start:]], dtype=torch.long, device=device)  # [1, n - start]
        # Explicit positions: the cache is the only other place they could come
        # from, and being explicit keeps GPT-2 (learned) and Llama (RoPE) in step.
        position_ids = torch.arange(start, n, dtype=torch.long, device=device).unsqueeze(0)  # [1, n - start]
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kw: s.cache},
                logits_to_keep=num_last,  # LM head over the rows we return only
            )
        except BaseException:
            # Some layers may have appended keys/values before the failure.
            self._crop(s, start)
            raise
        s.cached = n
        logits = out.logits[0, -num_last:, :]  # [num_last, V]
        return logits.float()

    def _check_batch(self, sessions: Sequence[KVSession], num_last: Sequence[int]) -> list[tuple[KVSession, int]]:
        """(session, num_last) pairs checked as `logits` checks them, plus batch rules; no side effects."""
        if isinstance(num_last, (int, str, bytes)) or not isinstance(num_last, Sequence):
            raise InvalidArgument(f"num_last must be a sequence of ints, one per session, got {num_last!r}")
        if len(sessions) != len(num_last):
            raise InvalidArgument(
                f"got {len(sessions)} sessions but {len(num_last)} num_last values; pass one per session"
            )
        seen: set[int] = set()
        pairs: list[tuple[KVSession, int]] = []
        for i, (s, k) in enumerate(zip(sessions, num_last)):
            if id(s) in seen:
                raise InvalidArgument(
                    f"sessions[{i}] appears more than once in one batch; a session can run once per forward"
                )
            seen.add(id(s))
            n = len(s.tokens)
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
                raise InvalidArgument(
                    f"num_last must be an int in [1, {n}] (the sequence length), got {k!r} (sessions[{i}])"
                )
            pairs.append((s, k))
        return pairs

    @torch.inference_mode()
    def logits_batch(
        self, sessions: Sequence[KVSession], num_last: Sequence[int], *, beside: Callable[[], None] | None = None
    ) -> list[Tensor]:
        """`logits(sessions[b], num_last[b])` for every b, computed in ONE model forward.

        beside: host work that needs nothing of this forward, run with it (SimRunner's emulated
        pass runs it inside the pass's time); on the CPU the forward is the host's own work, so
        it runs first.

        Returns one [num_last[b], V] float32 tensor per session, with the same
        side effects as the per-session calls: each session's cache then holds
        exactly the keys/values of all its tokens (``cached == len(tokens)``).
        Invalid input raises InvalidArgument before anything changes, as does a
        session passed twice. On a failed forward every session is left cropped
        to the positions it had cached before the call (at most), still usable.

        How: session b recomputes positions [start_b, n_b) (start_b as in
        `logits`). The batch gets a fresh cache of L = max start_b positions,
        each session's keys/values left-padded with zeros to L, and the new
        tokens right-padded to S = max (n_b - start_b); a [B, L + S] attention
        mask hides both paddings and explicit position ids give every row its
        own positions. Sessions with nothing cached are all padding in the
        past part.

        Memory: besides the sessions' own caches, the call transiently holds
        B * (L + S) positions of keys/values for every layer (the padded batch
        cache; one layer at a time also briefly holds its B * L before growing),
        so a batch of one long and many short sessions costs as if all were
        long. A single session skips all this and runs `logits`.
        """
        pairs = self._check_batch(sessions, num_last)
        if beside is not None:
            beside()
        if not pairs:
            return []
        if len(pairs) == 1:
            return [self.logits(*pairs[0])]

        starts: list[int] = []
        for s, k in pairs:
            start = min(s.cached, len(s.tokens) - k)
            self._crop(s, start)
            starts.append(start)
        try:
            return self._forward_batch(pairs, starts)
        except BaseException:
            # Layers may have appended keys/values to some sessions before the failure.
            for (s, _), start in zip(pairs, starts):
                self._crop(s, start)
            raise

    def _forward_batch(self, pairs: list[tuple[KVSession, int]], starts: list[int]) -> list[Tensor]:
        """The batched forward of `logits_batch`; sessions are already cropped to `starts`."""
        device = self.model.device
        B = len(pairs)
        lens = [len(s.tokens) for s, _ in pairs]
        news = [n - start for n, start in zip(lens, starts)]  # s_b >= num_last_b >= 1
        L, S = max(starts), max(news)

        input_ids = torch.zeros(B, S, dtype=torch.long, device=device)  # right padding with id 0
        mask = torch.zeros(B, L + S, dtype=torch.long, device=device)
        rows = torch.zeros(B, S, dtype=torch.bool, device=device)  # which output rows each session returns
        for b, ((s, k), start, new) in enumerate(zip(pairs, starts, news)):
            input_ids[b, :new] = torch.tensor(s.tokens[start:], dtype=torch.long)
            mask[b, L - start : L + new] = 1
            rows[b, new - k : new] = True
        # Padded rows get positions past their sequence: clamp them into the
        # table (GPT-2's positions are learned); their outputs are never read.
        offsets = torch.arange(S, dtype=torch.long, device=device)
        position_ids = (torch.tensor(starts, dtype=torch.long, device=device)[:, None] + offsets).clamp_(
            max=self.max_context - 1
        )

        # The past: each session's keys/values right-aligned at L, zeros before
        # (zeros, not garbage: a masked score still multiplies the key, and
        # NaN * 0 would poison the row). Layers are set directly instead of
        # through `update`, which would copy the padded tensor once more.
        cache = DynamicCache()
        if L > 0:
            ref = pairs[starts.index(L)][0].cache
            for layer_idx, ref_layer in enumerate(_layers(ref)):
                ref_keys, ref_values = _kv(ref_layer)
                _, H, _, D = ref_keys.shape
                keys = ref_keys.new_zeros(B, H, L, D)
                values = ref_values.new_zeros(B, H, L, ref_values.shape[-1])
                for b, ((s, _), start) in enumerate(zip(pairs, starts)):
                    if start:
                        layer_keys, layer_values = _kv(_layers(s.cache)[layer_idx])
                        keys[b, :, L - start :] = layer_keys[0]
                        values[b, :, L - start :] = layer_values[0]
                batch_layer = DynamicLayer()
                batch_layer.lazy_initialization(keys, values)
                batch_layer.keys, batch_layer.values = keys, values
                cache.layers.append(batch_layer)
                del keys, values  # the layer holds them; the forward's cat replaces and frees them

        # HF turns the 2D mask into the 4D causal mask itself, padding in the
        # cached part included (query i sits at L + i; checked for Llama and
        # GPT-2 with SDPA and eager attention in tests/unit/core/model/test_runner_batch.py).
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            # A 2D boolean mask keeps exactly the rows returned, flattened in
            # (session, position) order: no LM head work on rows nobody reads
            # (padding, or recomputed positions before the last num_last).
            # Older transformers: the head runs over every row (0), selected below.
            logits_to_keep=rows if self._row_mask else 0,
            **{self._cache_kw: cache},
        )
        flat = out.logits
        if flat.ndim == 3:  # all rows came back (older transformers, or a model that ignored the mask): select here
            flat = flat[rows]
        del out

        # Write back only the new positions: each session's cache already holds
        # [0, start_b) exactly, and `update` concatenates, so the result is a
        # fresh contiguous tensor and the padded batch cache is freed below.
        for layer_idx, layer in enumerate(_layers(cache)):
            batch_keys, batch_values = _kv(layer)
            for b, ((s, _), new) in enumerate(zip(pairs, news)):
                s.cache.update(
                    batch_keys[b : b + 1, :, L : L + new],
                    batch_values[b : b + 1, :, L : L + new],
                    layer_idx,
                )
        del cache
        for (s, _), n in zip(pairs, lens):
            s.cached = n
        return [chunk.float() for chunk in flat.split([k for _, k in pairs])]

    # ---- trees (specd.core.model.tree_forward) ---------------------------

    def tree_logits_batch(self, sessions: Sequence[KVSession], trees: Sequence[DraftTree]) -> list[TreeLogits]:
        """Each session's draft tree verified after its tokens, all in ONE forward (a 4D tree mask).

        A result's logits [N+1, V]: row 0 after the session's last token, row 1 + i after node i
        (node i at position len(tokens) + depth_i - 1). Each cache then holds exactly its tokens;
        the nodes' keys/values wait in the result for `keep_tree_path`.
        """
        args = (self._cache_kw, self._row_mask, self.max_context, self.vocab_size)
        return tree_forward.forward_trees(self.model, *args, sessions, trees)

    def keep_tree_path(self, s: KVSession, result: TreeLogits, path: Sequence[int]) -> None:
        """Append the accepted path's tokens to s, with their KV from the tree pass (prefix + path)."""
        tree_forward.keep_path(s, result, path)

    @property
    def device(self) -> torch.device:
        """Where the model's weights and the sessions' caches live."""
        return self.model.device

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one cached token costs (keys + values of every layer, this process's heads)."""
        if self._kv_bytes_per_token is None:
            probe = self.new_session([0])
            self.logits(probe, 1)
            self._kv_bytes_per_token = self.kv_bytes(probe)
            self.release(probe)
        return self._kv_bytes_per_token

    def release(self, s: KVSession) -> None:
        """The owner is done with `s`. Nothing to free here (the cache dies with the
        session object); a tensor-parallel runner tells its followers to drop theirs."""

    # ---- memory ---------------------------------------------------------

    @staticmethod
    def kv_bytes(s: KVSession) -> int:
        """Bytes of the key/value tensors of the session's cached positions.

        After a crop the old storage stays alive until the next forward
        appends (DynamicCache grows by concatenation), so right after a
        rollback the process may briefly hold more than this.
        """
        total = 0
        for layer in s.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, Tensor):
                    total += t.numel() * t.element_size()
        return total

    # ---- internals ------------------------------------------------------

    @staticmethod
    @torch.inference_mode()
    def _crop(s: KVSession, length: int) -> None:
        """Drop cached positions >= length, layer by layer (DynamicCache.crop takes -count)."""
        for layer in _layers(s.cache):
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        s.cached = min(s.cached, length)
