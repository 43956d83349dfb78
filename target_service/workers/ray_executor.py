"""Followers as Ray actors in a placement group (the `ray` executor), for groups that span nodes.

One bundle per follower rank ({"CPU": 1, "GPU": 1} when --device is cuda,
else {"CPU": 1}), PACK strategy; --ray-address joins a cluster, else a
private local Ray is started and stopped with the service.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from specd.core.errors import FailedPrecondition, Unavailable
from target_service.workers.follower import RayWorker
from target_service.workers.rendezvous import Rendezvous, WorkerSpec

log = logging.getLogger(__name__)

LOCAL_RAY_OBJECT_STORE_BYTES = 128 * 1024**2  # a Ray that specd starts itself; nothing big goes through it


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Unavailable, at once, if nothing listens at a Ray address (HOST:PORT or ray://HOST:PORT)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise FailedPrecondition(f"--ray-address {address!r} is not HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise Unavailable(
            f"cannot reach the Ray cluster at {address!r} ({exc}): check --ray-address (the head's GCS "
            "address, port 6379 by default, or ray://HOST:10001 for Ray Client) and that this machine can reach it"
        ) from None


def _import_ray() -> Any:
    try:
        import ray  # noqa: PLC0415 - an optional dependency (specd[ray]), loaded for --executor ray only
    except ImportError:
        raise FailedPrecondition("--executor ray needs Ray: pip install 'specd[ray]' (or use --executor mp)") from None
    return ray


class RayExecutor:
    """Followers as Ray actors, one placement-group bundle each."""

    name = "ray"

    def __init__(self, address: str = "", *, gpu: bool = False) -> None:
        ray = _import_ray()
        self._ray = ray
        self._owns_ray = False
        self._gpu = gpu
        self._bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._pg: Any = None
        self._pg_ready: Any = None
        if not ray.is_initialized():
            if address and address != "auto":
                _check_reachable(address)  # ray.init retries an unreachable address for minutes
            try:
                if address:
                    ray.init(address=address, log_to_driver=True)
                else:  # a private local Ray, stopped with the service
                    ray.init(
                        num_cpus=os.cpu_count() or 1,
                        object_store_memory=LOCAL_RAY_OBJECT_STORE_BYTES,
                        include_dashboard=False,
                        log_to_driver=True,
                    )
                    self._owns_ray = True
            except Exception as exc:  # ConnectionError, TimeoutError, auth errors, ...
                where = f"the Ray cluster at {address!r}" if address else "a local Ray"
                raise Unavailable(
                    f"could not start or join {where}: {exc}. Check the address (`ray status` on the head "
                    "node), that this machine can reach it, and, if the cluster uses token auth (Ray's default), "
                    "that RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) match the cluster's"
                ) from exc

    def advertise_host(self) -> str:
        return str(self._ray.util.get_node_ip_address())

    def launch(self, spec: WorkerSpec, rdv: Rendezvous) -> None:
        from ray.util.placement_group import placement_group  # noqa: PLC0415 - optional dependency
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415 - optional

        ray = self._ray
        self._pg = placement_group([dict(self._bundle) for _ in range(1, spec.tp)], strategy="PACK")
        self._pg_ready = self._pg.ready()
        remote = ray.remote(RayWorker)
        self._actors, self._runs = [], []
        for rank in range(1, spec.tp):
            actor = remote.options(
                num_cpus=self._bundle["CPU"],
                num_gpus=self._bundle.get("GPU", 0),
                max_restarts=0,  # the group restarts as a whole
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank - 1
                ),
            ).remote()
            self._actors.append(actor)
            self._runs.append(actor.run.remote(spec, rank, rdv))

    def dead(self) -> str | None:
        runs = list(self._runs)
        if not runs:
            return None
        done, _ = self._ray.wait(runs, num_returns=len(runs), timeout=0)
        for ref in done:
            rank = runs.index(ref) + 1
            try:
                self._ray.get(ref, timeout=1)
            except Exception as exc:  # noqa: BLE001 - RayActorError, the follower's own exception
                return f"rank {rank} (Ray actor) died: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            return f"rank {rank} (Ray actor) stopped"
        return None

    def wait_death(self, timeout_s: float) -> str | None:
        runs = list(self._runs)
        if runs:
            self._ray.wait(runs, num_returns=1, timeout=timeout_s)
        else:
            time.sleep(timeout_s)
        return self.dead()

    def hint(self) -> str:
        n = len(self._actors)
        if self._pg_ready is not None and not self._ray.wait([self._pg_ready], timeout=0)[0]:
            return (
                f"Ray has not placed the placement group ({n} bundles of {self._bundle}): check `ray status` "
                f"for {n} free {'GPUs' if self._gpu else 'CPUs'} across the nodes"
            )
        return (
            "the Ray actors are placed but have not loaded the model: check that every Ray node can import "
            "specd and read the model folder, and the actor logs (ray logs / /tmp/ray/session_latest/logs)"
        )

    def stop(self, grace_s: float) -> None:
        ray = self._ray
        if self._runs and grace_s > 0:
            ray.wait(list(self._runs), num_returns=len(self._runs), timeout=grace_s)
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - already gone
                log.debug("ray.kill: %s", exc)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group  # noqa: PLC0415 - optional dependency

            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # noqa: BLE001 - already removed, or Ray is gone
                log.debug("remove_placement_group: %s", exc)
        self._actors, self._runs, self._pg, self._pg_ready = [], [], None, None

    def close(self) -> None:
        self.stop(0.0)
        if self._owns_ray:
            self._ray.shutdown()
