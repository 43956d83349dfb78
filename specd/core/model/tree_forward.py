"""Tree verification on a causal LM: a whole draft tree per session in ONE forward, then KV compaction.

`forward_trees` runs, for each session, its uncached committed tokens and its
tree's nodes through one model forward with a 4D tree mask
(specd.core.model.tree_attention) and returns per-node logits. Each session's
cache then holds exactly its tokens, as after `CausalLMRunner.logits`; the
nodes' keys/values are kept aside in the result (`TreeLogits.node_kv`), not in
the session, because only one path of them will be kept. `keep_path` appends
the accepted path's tokens and their keys/values, in path order: the session's
cache becomes prefix + accepted nodes, exactly what running that path as a
chain would have cached (tests/unit/core/model/test_tree_forward.py).

CausalLMRunner.tree_logits_batch / keep_tree_path are the entry points; this
module takes the model and the sessions' parts, so that it needs no import
of the runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specd.core.errors import InvalidArgument
from specd.core.model.tree_attention import TreeLayout, tree_layout
from specd.core.sampling.tree import DraftTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TreeLogits", "TreeSession", "check_trees", "forward_trees", "keep_path"]

NodeKV = tuple[tuple[Tensor, Tensor], ...]  # per layer: (keys [1, H, N, D], values [1, H, N, Dv])


class TreeSession(Protocol):
    """What this module reads and edits of a session (CausalLMRunner's KVSession)."""

    tokens: list[int]
    cached: int
    cache: DynamicCache


@dataclass(frozen=True, eq=False)
class TreeLogits:
    """One session's tree pass."""

    logits: Tensor  # [N+1, V] float32: row 0 after the session's last token, row 1+i after node i
    tree: DraftTree
    committed: int  # the session's length when verified: keep_path refuses a session edited since
    node_kv: NodeKV | None  # the nodes' keys/values; None for an emulated model (no tensors)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    return cast(list[DynamicLayer], cache.layers)


def _kv(layer: DynamicLayer) -> tuple[Tensor, Tensor]:
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def _crop(s: TreeSession, length: int) -> None:
    for layer in _layers(s.cache):
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
    s.cached = min(s.cached, length)


def check_trees(sessions: Sequence[TreeSession], trees: Sequence[DraftTree], vocab_size: int, max_context: int) -> None:
    """InvalidArgument before anything changes: one tree per distinct session, ids in range, room for the deepest."""
    if len(sessions) != len(trees):
        raise InvalidArgument(f"got {len(sessions)} sessions but {len(trees)} trees; pass one tree per session")
    if len({id(s) for s in sessions}) != len(sessions):
        raise InvalidArgument("a session appears more than once in one batch; a session can run once per forward")
    for i, (s, t) in enumerate(zip(sessions, trees)):
        if not isinstance(t, DraftTree):
            raise InvalidArgument(f"trees[{i}] is a {type(t).__name__}, not a DraftTree")
        if t.token_ids and not 0 <= min(t.token_ids) <= max(t.token_ids) < vocab_size:
            raise InvalidArgument(f"trees[{i}] has a token id outside the vocabulary [0, {vocab_size})")
        if not s.tokens:
            raise InvalidArgument(f"sessions[{i}] is empty; a tree follows at least one token")
        if len(s.tokens) + t.depth > max_context:
            raise InvalidArgument(
                f"sessions[{i}]: {len(s.tokens)} tokens and a tree {t.depth} deep exceed the context of "
                f"{max_context}; send a shallower tree"
            )


@torch.inference_mode()
def forward_trees(
    model: PreTrainedModel,
    cache_kw: str,
    row_mask: bool,
    max_context: int,
    vocab_size: int,
    sessions: Sequence[TreeSession],
    trees: Sequence[DraftTree],
) -> list[TreeLogits]:
    """Per session, the logits of its last token and of every node of its tree, in one forward.

    cache_kw: the forward's cache keyword; row_mask: whether it takes a 2D boolean logits_to_keep
    (both as CausalLMRunner reads them off the model). On a failed forward every session is
    left cropped to what it had cached (at most), still usable.
    """
    check_trees(sessions, trees, vocab_size, max_context)
    if not sessions:
        return []
    starts = []
    for s in sessions:
        start = min(s.cached, len(s.tokens) - 1)  # the last token runs: its logits predict depth 1
        _crop(s, start)
        starts.append(start)
    layout = tree_layout(
        starts,
        [s.tokens[start:] for s, start in zip(sessions, starts)],
        trees,
        dtype=model.dtype,
        device=model.device,
        max_position=max_context - 1,
    )
    try:
        flat, node_kv = _run(model, cache_kw, row_mask, sessions, starts, layout)
    except BaseException:
        for s, start in zip(sessions, starts):
            _crop(s, start)
        raise
    for s in sessions:
        s.cached = len(s.tokens)
    chunks = flat.float().split([n + 1 for n in layout.nodes])
    return [TreeLogits(c, t, len(s.tokens), kv) for c, t, s, kv in zip(chunks, trees, sessions, node_kv)]


def _run(
    model: PreTrainedModel,
    cache_kw: str,
    row_mask: bool,
    sessions: Sequence[TreeSession],
    starts: list[int],
    layout: TreeLayout,
) -> tuple[Tensor, list[NodeKV]]:
    """The forward; writes each tail into its session's cache and returns (logit rows, nodes' KV)."""
    B, L = len(sessions), layout.past
    # One session runs on its own cache (L == start: no padding, no copy); several on a padded one.
    cache = sessions[0].cache if B == 1 else _padded_past(sessions, starts, L)
    out = model(
        input_ids=layout.input_ids,
        attention_mask=layout.mask,
        position_ids=layout.position_ids,
        use_cache=True,
        logits_to_keep=layout.rows if row_mask else 0,
        **{cache_kw: cache},
    )
    flat = out.logits
    if flat.ndim == 3:  # older transformers: the head ran over every row
        flat = flat[layout.rows]
    del out
    node_kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(B)]
    for layer_idx, layer in enumerate(_layers(cache)):
        keys, values = _kv(layer)
        for b, (s, m, n) in enumerate(zip(sessions, layout.tails, layout.nodes)):
            first = L + m  # the nodes' columns: [L + m, L + m + n)
            node_kv[b].append(
                (keys[b : b + 1, :, first : first + n].clone(), values[b : b + 1, :, first : first + n].clone())
            )
            if B > 1:  # the tail's keys/values into the session's own cache
                s.cache.update(keys[b : b + 1, :, L:first], values[b : b + 1, :, L:first], layer_idx)
    if B == 1:
        _crop(sessions[0], starts[0] + layout.tails[0])  # drop the nodes: the cache holds the tokens
    return flat, [tuple(kv) for kv in node_kv]


def _padded_past(sessions: Sequence[TreeSession], starts: list[int], L: int) -> DynamicCache:
    """A batch cache of L positions: each session's keys/values right-aligned, zeros before (as logits_batch)."""
    cache = DynamicCache()
    if L == 0:
        return cache
    ref = sessions[starts.index(L)].cache
    B = len(sessions)
    for layer_idx, ref_layer in enumerate(_layers(ref)):
        ref_keys, ref_values = _kv(ref_layer)
        keys = ref_keys.new_zeros(B, ref_keys.shape[1], L, ref_keys.shape[3])
        values = ref_values.new_zeros(B, ref_values.shape[1], L, ref_values.shape[3])
        for b, (s, start) in enumerate(zip(sessions, starts)):
            if start:
                k, v = _kv(_layers(s.cache)[layer_idx])
                keys[b, :, L - start :] = k[0]
                values[b, :, L - start :] = v[0]
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def keep_path(s: TreeSession, result: TreeLogits, path: Sequence[int]) -> None:
    """Append the accepted nodes' tokens to `s`, and their keys/values from the tree pass (in path order).

    The cache becomes prefix + accepted path, as a chain over that path would have left it.
    If the session's cache fell behind since the pass (a rollback), only the tokens are
    appended and the cache refills on the next forward, as for any appended token.
    """
    tree = result.tree
    if not tree.is_path(list(path)):
        raise InvalidArgument(f"nodes {list(path)} are not a path down the tree from the committed prefix")
    if len(s.tokens) != result.committed:
        raise InvalidArgument(
            f"the session has {len(s.tokens)} tokens but its tree was verified after {result.committed}; "
            "verify the tree again"
        )
    if not path:
        return
    in_step = s.cached == result.committed
    s.tokens.extend(tree.token_ids[i] for i in path)
    if not in_step:
        return
    if result.node_kv is not None:
        for layer_idx, (keys, values) in enumerate(result.node_kv):
            idx = torch.tensor(list(path), dtype=torch.int64, device=keys.device)
            s.cache.update(keys.index_select(2, idx), values.index_select(2, idx), layer_idx)
    s.cached = len(s.tokens)
