"""A follower rank (1..N-1): load its shard, report ready in the store, then mirror rank 0's
forwards (`commands.Mirror`) until told to stop. The entry point of both executors' processes."""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from specd.core.model import tensor_parallel
from specd.core.model.loading import LoadedModel, load_pretrained
from specd.core.model.runner import CausalLMRunner
from target_service.workers.commands import Mirror, receive
from target_service.workers.rendezvous import Rendezvous, WorkerSpec, destroy_groups, init_groups


def load_shard(spec: WorkerSpec, rank: int, device: str) -> LoadedModel:
    """Load the model folder plainly, keep rank `rank`'s shard, move it to `device`."""
    loaded = load_pretrained(spec.folder)
    tensor_parallel.shard_model(loaded.model, rank, spec.tp)
    loaded.model.to(device)
    return loaded


def _follower_device(spec: WorkerSpec, rank: int, executor: str) -> str:
    if not spec.device.startswith("cuda"):
        return "cpu"
    # Ray gives each actor one GPU (CUDA_VISIBLE_DEVICES); local processes take GPU `rank`.
    return "cuda:0" if executor == "ray" else f"cuda:{rank}"


def run_follower(spec: WorkerSpec, rank: int, rdv: Rendezvous, executor: str = "mp") -> None:
    """A follower rank: load the shard, report ready, mirror rank 0's forwards until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s specd-target-rank{rank} %(levelname)s: %(message)s")
    store = dist.TCPStore(rdv.host, rdv.port, is_master=False, timeout=timedelta(seconds=spec.ready_timeout_s))
    try:
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        device = _follower_device(spec, rank, executor)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        model = load_shard(spec, rank, device).model
        sharded, replicated = tensor_parallel.weight_bytes(model)
        info = {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": device,
            "sharded_bytes": sharded,
            "replicated_bytes": replicated,
        }
        store.set(f"ready/{rank}", json.dumps(info))
    except BaseException as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    commands = init_groups(spec, store, rank)
    mirror = Mirror(CausalLMRunner(model), rank)
    try:
        while mirror.apply(receive(commands)):
            pass
    finally:
        destroy_groups()


class RayWorker:
    """A follower rank as a Ray actor (kept a plain class; `ray.remote` is applied where actors are made)."""

    def run(self, spec: WorkerSpec, rank: int, rdv: Rendezvous) -> None:
        run_follower(spec, rank, rdv, executor="ray")
