"""The broadcast protocol: what rank 0 tells its followers before every forward, and what they do.

Followers mirror rank 0's forward passes and nothing else. A command is a
small picklable tuple, broadcast from rank 0 on the gloo command group:

    ("forward", tp_id, start, tokens, num_last)       one session's forward
    ("forward_batch", [(tp_id, start, tokens, num_last), ...])
                                                      one batched forward, sessions in rank 0's order
    ("release", [tp_id, ...])                         sessions rank 0 closed
    ("stop",)                                         the group is shutting down

`start` is the first position rank 0 does not have cached and `tokens` the
session's tokens from there. A follower crops its cache of the session to
`start`, replaces its tokens from there, and runs the same forward (the
collectives inside pair up layer by layer), so its KV cache is always
exactly rank 0's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from specd.core.model.runner import CausalLMRunner, KVSession

Command = tuple[Any, ...]
BatchRow = tuple[int, int, list[int], int]  # (tp_id, start, tokens[start:], num_last)

STOP: Command = ("stop",)


def forward(tp_id: int, start: int, tokens: list[int], num_last: int) -> Command:
    return ("forward", tp_id, start, tokens, num_last)


def forward_batch(rows: list[BatchRow]) -> Command:
    return ("forward_batch", rows)


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

    def apply(self, op: Command) -> bool:
        """Carry out one command; False once told to stop."""
        if op[0] == "forward":
            _, sid, start, tokens, num_last = op
            s = self._follow(sid, start, tokens)
            self.runner.logits(s, num_last)  # the same forward as rank 0; logits discarded
        elif op[0] == "forward_batch":  # the same batched forward as rank 0: same sessions, same order
            batch = [(self._follow(sid, start, tokens), num_last) for sid, start, tokens, num_last in op[1]]
            self.runner.logits_batch([s for s, _ in batch], [k for _, k in batch])
        elif op[0] == "release":
            for sid in op[1]:
                self.sessions.pop(sid, None)
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
