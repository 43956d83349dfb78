"""The broadcast protocol: what rank 0 tells its followers before every forward, and what they do.

Followers mirror rank 0's forward passes and nothing else. A command is a
small picklable tuple, broadcast from rank 0 on the gloo command group:

    ("forward", tp_id, start, tokens, num_last)       one session's forward
    ("forward_batch", [(tp_id, start, tokens, num_last), ...])
                                                      one batched forward, sessions in rank 0's order
    ("tree_batch", [(tp_id, start, tokens, token_ids, parents), ...])
                                                      one tree forward (tree_logits_batch), sessions in
                                                      rank 0's order; each tree's ids and parents, no q
    ("keep", [(tp_id, path), ...], command)           the tree paths rank 0 kept since its last command
                                                      (keep_tree_path, in order), then `command`
    ("release", [tp_id, ...])                         sessions rank 0 closed
    ("stop",)                                         the group is shutting down

`start` is the first position rank 0 does not have cached and `tokens` the
session's tokens from there. A follower crops its cache of the session to
`start`, replaces its tokens from there, and runs the same forward (the
collectives inside pair up layer by layer), so its KV cache is always
exactly rank 0's.

A tree forward leaves each session's nodes' keys/values aside on the follower
(its last TreeLogits, logits dropped) until rank 0 keeps a path. Rank 0 does
not broadcast a keep on its own: it queues it, and its next command carries
the queued keeps first (a "keep" wrapper), so a tree round costs one command
like a chain round, and the keep lands before any forward that relies on the
kept nodes being cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from specd.core.errors import InvalidArgument
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.tree_forward import TreeLogits
from specd.core.sampling.tree import DraftTree

Command = tuple[Any, ...]
BatchRow = tuple[int, int, list[int], int]  # (tp_id, start, tokens[start:], num_last)
TreeRow = tuple[int, int, list[int], list[int], list[int]]  # (tp_id, start, tokens[start:], node ids, node parents)
Kept = tuple[int, list[int]]  # (tp_id, accepted path: node indices, root first)

STOP: Command = ("stop",)


def forward(tp_id: int, start: int, tokens: list[int], num_last: int) -> Command:
    return ("forward", tp_id, start, tokens, num_last)


def forward_batch(rows: list[BatchRow]) -> Command:
    return ("forward_batch", rows)


def tree_batch(rows: list[TreeRow]) -> Command:
    return ("tree_batch", rows)


def keep(kept: list[Kept], then: Command) -> Command:
    return ("keep", kept, then)


def release(tp_ids: list[int]) -> Command:
    return ("release", tp_ids)


def broadcast(command: Command, group: dist.ProcessGroup | None) -> None:
    """Rank 0: send one command to every follower."""
    dist.broadcast_object_list([command], src=0, group=group)


def receive(group: dist.ProcessGroup) -> Command:
    """A follower: wait for rank 0's next command."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Mirror:
    """A follower's sessions, each brought to rank 0's before the same forward runs."""

    def __init__(self, runner: CausalLMRunner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self.sessions: dict[int, KVSession] = {}
        self.trees: dict[int, TreeLogits] = {}  # each session's last tree pass, until rank 0 keeps a path of it

    def apply(self, op: Command) -> bool:
        """Carry out one command; False once told to stop."""
        if op[0] == "forward":
            _, sid, start, tokens, num_last = op
            s = self._follow(sid, start, tokens)
            self.runner.logits(s, num_last)  # the same forward as rank 0; logits discarded
        elif op[0] == "forward_batch":  # the same batched forward as rank 0: same sessions, same order
            batch = [(self._follow(sid, start, tokens), num_last) for sid, start, tokens, num_last in op[1]]
            self.runner.logits_batch([s for s, _ in batch], [k for _, k in batch])
        elif op[0] == "tree_batch":  # the same tree forward as rank 0: same sessions, order, trees, mask
            rows: list[TreeRow] = op[1]
            sessions = [self._follow(sid, start, tokens) for sid, start, tokens, _, _ in rows]
            trees = [DraftTree(tuple(ids), tuple(parents)) for _, _, _, ids, parents in rows]  # checked on rank 0
            for (sid, *_), res in zip(rows, self.runner.tree_logits_batch(sessions, trees)):
                # keep_tree_path reads the nodes' KV only: drop the [N+1, V] logits, held until the keep
                self.trees[sid] = replace(res, logits=res.logits.new_empty((0, res.logits.shape[-1])))
        elif op[0] == "keep":  # rank 0's keeps since its last command, in its order, then that command
            for sid, path in op[1]:
                self._keep(sid, path)
            return self.apply(op[2])
        elif op[0] == "release":
            for sid in op[1]:
                self.sessions.pop(sid, None)
                self.trees.pop(sid, None)
        elif op[0] == "stop":
            return False
        else:
            raise RuntimeError(f"unknown command {op[0]!r}")
        return True

    def _follow(self, sid: int, start: int, tokens: Sequence[int]) -> KVSession:
        """The session brought to rank 0's: tokens[start:] replaced, cache cropped to start."""
        s = self.sessions.get(sid) or self.sessions.setdefault(sid, KVSession(tokens=[]))
        if s.cached < start:  # rank 0 believes we cached more than we did
            raise RuntimeError(f"rank {self.rank} is out of step on session {sid}: {s.cached} < {start}")
        del s.tokens[start:]
        s.tokens.extend(tokens)
        self.runner._crop(s, start)
        return s

    @torch.inference_mode()
    def _keep(self, sid: int, path: list[int]) -> None:
        """Rank 0's keep_tree_path on this rank's heads: the path's tokens and its nodes' KV appended."""
        s, result = self.sessions.get(sid), self.trees.pop(sid, None)
        if s is None or result is None:
            raise RuntimeError(f"rank {self.rank} is out of step on session {sid}: no tree pass to keep a path of")
        try:
            self.runner.keep_tree_path(s, result, path)
        except InvalidArgument as exc:  # rank 0 kept this very path of the same pass
            raise RuntimeError(f"rank {self.rank} is out of step on session {sid}: {exc}") from exc
