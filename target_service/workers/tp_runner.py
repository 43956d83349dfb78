"""Rank 0's runner: the `CausalLMRunner` interface over a worker group, so the Verifier does not
change; every forward is announced to the followers first (target_service.workers.commands), tree
verification (tree_logits_batch / keep_tree_path) included."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specd.core.errors import SpecdError, Unavailable
from specd.core.model import tensor_parallel, tree_forward
from specd.core.model.loading import LoadedModel
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.tree_forward import TreeLogits
from specd.core.sampling.tree import DraftTree
from target_service.workers import commands
from target_service.workers.executor import make_executor
from target_service.workers.follower import load_shard
from target_service.workers.group import WorkerGroup
from target_service.workers.rendezvous import COLLECTIVE_TIMEOUT_S, WorkerSpec

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TPSession(KVSession):
    """A KVSession whose followers' caches are known under `tp_id` in group generation `generation`."""

    tp_id: int = 0
    generation: int = 0


class TensorParallelRunner(CausalLMRunner):
    """`CausalLMRunner` on rank 0 of a worker group: every forward is mirrored by the followers."""

    def __init__(self, model: PreTrainedModel, group: WorkerGroup, *, max_context: int | None = None) -> None:
        super().__init__(model, max_context=max_context)
        self.group = group
        self._ids = itertools.count(1)
        # Paths kept since the last command, (generation, tp_id, path), in order: the next command
        # carries them (_send). Not a broadcast of their own: a tree round then costs one command,
        # as a chain round does, and a follower needs a kept path only before its next forward.
        self._kept: list[tuple[int, int, list[int]]] = []

    def new_session(self, token_ids: Sequence[int]) -> TPSession:
        plain = super().new_session(token_ids)
        return TPSession(tokens=plain.tokens, tp_id=next(self._ids), generation=self.group.generation)

    def logits(self, s: KVSession, num_last: int = 1) -> torch.Tensor:
        assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
        n = len(s.tokens)
        if isinstance(num_last, bool) or not isinstance(num_last, int) or not 1 <= num_last <= n:
            return super().logits(s, num_last)  # raises InvalidArgument before any collective
        with self.group.collective():
            self._sync_generation(s)
            start = min(s.cached, n - num_last)  # what CausalLMRunner.logits will compute
            self._send(commands.forward(s.tp_id, start, s.tokens[start:], num_last))
            return super().logits(s, num_last)

    def logits_batch(
        self, sessions: Sequence[KVSession], num_last: Sequence[int], *, beside: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """One batched forward on every rank: the followers get the sessions' (start, new tokens) in
        order and run the same `CausalLMRunner.logits_batch`, so the padded shapes, and with them the
        collectives inside the model, match rank 0's. beside: as CausalLMRunner's (run first)."""
        pairs = self._check_batch(sessions, num_last)  # the same InvalidArgument as the batched runner
        if beside is not None:
            beside()
        if len(pairs) <= 1:
            return [self.logits(s, k) for s, k in pairs]  # one session: the plain forward command
        with self.group.collective():
            batch: list[commands.BatchRow] = []
            for s, k in pairs:
                tp_id = self._sync_generation(s)
                start = min(s.cached, len(s.tokens) - k)  # what CausalLMRunner.logits_batch will compute
                batch.append((tp_id, start, s.tokens[start:], k))
            self._send(commands.forward_batch(batch))
            return super().logits_batch([s for s, _ in pairs], [k for _, k in pairs])

    def tree_logits_batch(self, sessions: Sequence[KVSession], trees: Sequence[DraftTree]) -> list[TreeLogits]:
        """One tree forward on every rank: the followers get each session's (start, new tokens) and each
        tree's ids and parents, in order, and run the same `CausalLMRunner.tree_logits_batch`, so the
        padded shapes and the tree mask, and with them the collectives inside the model, match rank 0's.
        Each follower keeps its sessions' node KV until `keep_tree_path` names a path."""
        self._check_trees(sessions, trees)  # the same InvalidArgument as the plain runner, before any collective
        if not sessions:
            return []
        with self.group.collective():
            rows: list[commands.TreeRow] = []
            for s, tree in zip(sessions, trees):
                tp_id = self._sync_generation(s)
                start = min(s.cached, len(s.tokens) - 1)  # what tree_forward.forward_trees will compute
                rows.append((tp_id, start, s.tokens[start:], list(tree.token_ids), list(tree.parents)))
            self._send(commands.tree_batch(rows))
            return super().tree_logits_batch(sessions, trees)

    def keep_tree_path(self, s: KVSession, result: TreeLogits, path: Sequence[int]) -> None:
        """Rank 0's keep now (InvalidArgument for a bad path or an edited session, nothing queued); the
        followers' at the start of the next command (_send)."""
        assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
        with_kv = s.cached == result.committed  # else keep_path appends tokens only (the cache fell behind)
        super().keep_tree_path(s, result, path)
        # Without KV kept here, the next forward starts at or before this rank's cache end, and cropping
        # the followers there is all they need; a restarted group holds nothing of the pass.
        if path and with_kv and s.generation == self.group.generation:
            self._kept.append((s.generation, s.tp_id, list(path)))

    def release(self, s: KVSession) -> None:
        if not isinstance(s, TPSession) or s.generation != self.group.generation:
            return
        self._kept = [k for k in self._kept if k[1] != s.tp_id]  # no use keeping what is released
        try:
            with self.group.collective():
                self._send(commands.release([s.tp_id]))
        except Unavailable:
            pass  # the group is restarting: the followers' caches are gone anyway

    def _sync_generation(self, s: KVSession) -> int:
        """s's tp_id, its cache cropped to nothing if the group restarted since its last forward (the
        followers hold nothing of it); call inside `collective()`."""
        assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
        if s.generation != self.group.generation:
            self._crop(s, 0)
            s.generation = self.group.generation
        return s.tp_id

    def _send(self, command: commands.Command) -> None:
        """Broadcast `command`, preceded by the paths kept since the last one (call inside `collective()`)."""
        kept = [(tp_id, path) for gen, tp_id, path in self._kept if gen == self.group.generation]
        self._kept.clear()  # a restarted group's followers hold no tree pass to keep a path of
        self.group.send(commands.keep(kept, command) if kept else command)

    def _check_trees(self, sessions: Sequence[KVSession], trees: Sequence[DraftTree]) -> None:
        """tree_forward.check_trees, and each tree's parents as the followers rebuild it
        (DraftTree.from_wire without q): a tree that fails there must fail here, before any broadcast."""
        for tree in trees:
            if isinstance(tree, DraftTree):  # check_trees names anything else
                DraftTree.from_wire(
                    tree.token_ids, tree.parents, [], self.vocab_size, max_nodes=len(tree), max_depth=self.max_context
                )
        tree_forward.check_trees(sessions, trees, self.vocab_size, self.max_context)


def build_tp_runner(
    folder: Path,
    *,
    tp: int,
    executor: str = "mp",
    device: str = "cpu",
    torch_threads: int = 0,
    ray_address: str = "",
    ready_timeout_s: float = 300.0,
    exit_on_failure: bool = False,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> tuple[LoadedModel, TensorParallelRunner]:
    """Rank 0's shard and runner, with followers 1..tp-1 started and ready."""
    tensor_parallel.check_model_folder(str(folder), tp)  # refuse before starting anything
    spec = WorkerSpec(
        folder=str(folder),
        tp=tp,
        device=device,
        torch_threads=torch_threads,
        collective_timeout_s=collective_timeout_s,
        ready_timeout_s=ready_timeout_s,
    )
    group = WorkerGroup(
        spec,
        make_executor(executor, ray_address=ray_address, gpu=device.startswith("cuda")),
        exit_on_failure=exit_on_failure,
    )
    box: list[LoadedModel] = []

    def load_rank0() -> None:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        box.append(load_shard(spec, 0, device))

    group.start(while_loading=load_rank0)
    loaded = box[0]
    try:
        runner = TensorParallelRunner(loaded.model, group)
    except SpecdError:
        group.shutdown()
        raise
    sharded, _ = tensor_parallel.weight_bytes(loaded.model)
    log.info("tp rank 0 ready: pid %d (%s), %d bytes of sharded weights", os.getpid(), device, sharded)
    return loaded, runner
