"""Rank 0's runner: the `CausalLMRunner` interface over a worker group, so the Verifier does not
change; every forward is announced to the followers first (target_service.workers.commands)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specd.core.errors import SpecdError, Unavailable
from specd.core.model import tensor_parallel
from specd.core.model.loading import LoadedModel
from specd.core.model.runner import CausalLMRunner, KVSession
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

    def new_session(self, token_ids: Sequence[int]) -> TPSession:
        plain = super().new_session(token_ids)
        return TPSession(tokens=plain.tokens, tp_id=next(self._ids), generation=self.group.generation)

    def logits(self, s: KVSession, num_last: int = 1) -> torch.Tensor:
        assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
        n = len(s.tokens)
        if isinstance(num_last, bool) or not isinstance(num_last, int) or not 1 <= num_last <= n:
            return super().logits(s, num_last)  # raises InvalidArgument before any collective
        with self.group.collective():
            if s.generation != self.group.generation:  # the followers restarted: they hold nothing
                self._crop(s, 0)
                s.generation = self.group.generation
            start = min(s.cached, n - num_last)  # what CausalLMRunner.logits will compute
            self.group.send(commands.forward(s.tp_id, start, s.tokens[start:], num_last))
            return super().logits(s, num_last)

    def logits_batch(self, sessions: Sequence[KVSession], num_last: Sequence[int]) -> list[torch.Tensor]:
        """One batched forward on every rank: the followers get the sessions' (start, new tokens) in
        order and run the same `CausalLMRunner.logits_batch`, so the padded shapes, and with them the
        collectives inside the model, match rank 0's."""
        pairs = self._check_batch(sessions, num_last)  # the same InvalidArgument as the batched runner
        if len(pairs) <= 1:
            return [self.logits(s, k) for s, k in pairs]  # one session: the plain forward command
        with self.group.collective():
            batch: list[commands.BatchRow] = []
            for s, k in pairs:
                assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
                if s.generation != self.group.generation:  # the followers restarted: they hold nothing
                    self._crop(s, 0)
                    s.generation = self.group.generation
                start = min(s.cached, len(s.tokens) - k)  # what CausalLMRunner.logits_batch will compute
                batch.append((s.tp_id, start, s.tokens[start:], k))
            self.group.send(commands.forward_batch(batch))
            return super().logits_batch([s for s, _ in pairs], [k for _, k in pairs])

    def release(self, s: KVSession) -> None:
        if not isinstance(s, TPSession) or s.generation != self.group.generation:
            return
        try:
            with self.group.collective():
                self.group.send(commands.release([s.tp_id]))
        except Unavailable:
            pass  # the group is restarting: the followers' caches are gone anyway


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
