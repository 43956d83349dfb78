"""The interface of an executor (what starts and stops the follower ranks) and the choice of one."""

from __future__ import annotations

from typing import Protocol

from specd.core.errors import FailedPrecondition
from target_service.workers.mp_executor import MpExecutor
from target_service.workers.ray_executor import RayExecutor
from target_service.workers.rendezvous import Rendezvous, WorkerSpec


class Executor(Protocol):
    """Starts and stops ranks 1..N-1 of one generation; rank 0 is the caller."""

    name: str

    def advertise_host(self) -> str:
        """The address followers reach rank 0's store at."""
        ...

    def launch(self, spec: WorkerSpec, rdv: Rendezvous) -> None: ...

    def dead(self) -> str | None:
        """Why a follower of the current generation is gone, or None while all run."""
        ...

    def wait_death(self, timeout_s: float) -> str | None:
        """Block up to timeout_s for a follower to die; `dead()` after."""
        ...

    def hint(self) -> str:
        """What an operator should check when followers do not become ready."""
        ...

    def stop(self, grace_s: float) -> None:
        """End this generation's followers (after `grace_s` to exit by themselves)."""
        ...

    def close(self) -> None: ...


def make_executor(kind: str, *, ray_address: str = "", gpu: bool = False) -> Executor:
    if kind == "mp":
        return MpExecutor()
    if kind == "ray":
        return RayExecutor(ray_address, gpu=gpu)
    raise FailedPrecondition(f"unknown executor {kind!r}; use mp or ray")
