"""Where the ranks of a tensor-parallel group meet: the spec each rank builds from, rank 0's
rendezvous store, and the process groups (one for the model's collectives, one for commands)."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a model collective waiting longer than this raises (hung rank)
COMMAND_TIMEOUT = timedelta(days=365)  # followers wait this long for the next command


@dataclass(frozen=True)
class WorkerSpec:
    """What any rank needs to build its shard; picklable (sent to processes and actors)."""

    folder: str
    tp: int
    device: str = "cpu"  # rank 0's device (cpu, cuda, cuda:0)
    torch_threads: int = 0
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    ready_timeout_s: float = 300.0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


@dataclass(frozen=True)
class Rendezvous:
    """Where followers of one generation of the group meet rank 0."""

    host: str
    port: int
    generation: int


def master_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a group generation, listening where its followers reach it.

    A TCPStore given only a port listens on every interface. Followers that are
    local processes (host 127.0.0.1) get a store on loopback alone: its socket is
    bound here and handed over (master_listen_fd), so nothing off the machine can
    join the group or read its keys. Followers on other nodes (Ray) need the pod's
    address; there the NetworkPolicy of the Ray pods is the fence.
    """
    timeout = timedelta(seconds=timeout_s)
    if host != "127.0.0.1":
        return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    store = dist.TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store owns the descriptor now, and closes it when it goes
    return store


def init_groups(spec: WorkerSpec, store: dist.Store, rank: int) -> dist.ProcessGroup:
    """Default group for the model (spec.backend) and a gloo group for commands; returns the latter."""
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.tp,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def destroy_groups() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - tearing down a broken group
            log.debug("destroying the process group: %s", exc)
