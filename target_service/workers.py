"""The target's tensor-parallel worker group: rank 0 serves, ranks 1..N-1 follow.

Rank 0 is the target service process itself: it owns the gRPC stream, the
sessions and the sampler, and runs its shard of the model through a
`TensorParallelRunner` (the `CausalLMRunner` interface, so the Verifier does
not change). Ranks 1..N-1 are followers started by an executor:

    mp   local processes (multiprocessing, spawn), the default
    ray  Ray actors in a placement group, one bundle per follower rank
         ({"CPU": 1, "GPU": 1} when --device is cuda, else {"CPU": 1}), PACK
         strategy so a group may span nodes; --ray-address joins a cluster

Protocol. Followers mirror rank 0's forward passes and nothing else: before
every forward rank 0 broadcasts one small command (session id, first
uncached position, the uncached tokens, rows of logits wanted). A follower
crops its own cache of that session to that position, then runs the same
forward (the collectives inside pair up layer by layer). Appends, roll-backs
and prefix edits on rank 0 only touch token lists; a follower's cache is
cropped lazily at the next forward, to exactly rank 0's, so the KV caches,
sharded with the heads, never disagree. Closing a session broadcasts a
release. Commands travel on a gloo group (CPU objects) with a long timeout
(followers sit idle in it between requests); the model's collectives use the
default group (gloo on CPU, NCCL on GPU) with a short one, so a hung rank
raises instead of hanging the service.

Failure. A follower that exits is seen by a monitor thread (process
sentinel / Ray task), and a collective that raises on rank 0 marks the group
failed too. Then: health goes NOT_SERVING, every runner call fails at once
with Unavailable (the servicer sends CODE_UNAVAILABLE in-band; the
coordinator retries within its budget), and the supervisor thread tears the
group down and forms a new one (new followers, new store, new process
group; rank 0 keeps its loaded shard) with backoff, then SERVING again.
Sessions survive on rank 0 and are recomputed on the next forward. With
--exit-on-worker-failure the process exits (code 3) for Kubernetes to
restart it instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from specd.core import tensor_parallel
from specd.core.errors import FailedPrecondition, SpecdError, Unavailable
from specd.core.models import LoadedModel, load_pretrained
from specd.core.runner import CausalLMRunner, KVSession

log = logging.getLogger(__name__)

__all__ = [
    "EXIT_WORKER_FAILURE",
    "MpExecutor",
    "RayExecutor",
    "TensorParallelRunner",
    "WorkerGroup",
    "WorkerSpec",
    "build_tp_runner",
]

EXIT_WORKER_FAILURE = 3  # process exit code with --exit-on-worker-failure
COLLECTIVE_TIMEOUT_S = 60.0  # a model collective waiting longer than this raises (hung rank)
COMMAND_TIMEOUT = timedelta(days=365)  # followers wait this long for the next command
LOCAL_RAY_OBJECT_STORE_BYTES = 128 * 1024**2  # a Ray that specd starts itself; nothing big goes through it
_RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest pause between restart attempts


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


# ---- every rank ------------------------------------------------------------------


def load_shard(spec: WorkerSpec, rank: int, device: str) -> LoadedModel:
    """Load the model folder plainly, keep rank `rank`'s shard, move it to `device`."""
    loaded = load_pretrained(spec.folder)
    tensor_parallel.shard_model(loaded.model, rank, spec.tp)
    # transformers decorates to() with functools.wraps(nn.Module.to), so its stub takes `self` as the device
    loaded.model.to(device)  # type: ignore[arg-type]
    return loaded


def _init_groups(spec: WorkerSpec, store: dist.Store, rank: int) -> dist.ProcessGroup:
    """Default group for the model (spec.backend) and a gloo group for commands; returns the latter."""
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.tp,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def _destroy_groups() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - tearing down a broken group
            log.debug("destroying the process group: %s", exc)


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
    commands = _init_groups(spec, store, rank)
    runner = CausalLMRunner(model)
    sessions: dict[int, KVSession] = {}
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=commands)
            op = box[0]
            if op[0] == "forward":
                _, sid, start, tokens, num_last = op
                s = _follow(runner, sessions, rank, sid, start, tokens)
                runner.logits(s, num_last)  # the same forward as rank 0; logits discarded
            elif op[0] == "forward_batch":  # the same batched forward as rank 0: same sessions, same order
                batch = [
                    (_follow(runner, sessions, rank, sid, start, tokens), num_last)
                    for sid, start, tokens, num_last in op[1]
                ]
                runner.logits_batch([s for s, _ in batch], [k for _, k in batch])
            elif op[0] == "release":
                for sid in op[1]:
                    sessions.pop(sid, None)
            elif op[0] == "stop":
                return
            else:
                raise RuntimeError(f"unknown command {op[0]!r}")
    finally:
        _destroy_groups()


def _follow(
    runner: CausalLMRunner, sessions: dict[int, KVSession], rank: int, sid: int, start: int, tokens: list[int]
) -> KVSession:
    """A follower's session brought to rank 0's: tokens[start:] replaced, cache cropped to start."""
    s = sessions.get(sid) or sessions.setdefault(sid, KVSession(tokens=[]))
    if s.cached < start:  # rank 0 believes we cached more than we did
        raise RuntimeError(f"rank {rank} is out of step on session {sid}: {s.cached} < {start}")
    del s.tokens[start:]
    s.tokens.extend(tokens)
    runner._crop(s, start)
    return s


class RayWorker:
    """A follower rank as a Ray actor (kept a plain class; `ray.remote` is applied where actors are made)."""

    def run(self, spec: WorkerSpec, rank: int, rdv: Rendezvous) -> None:
        run_follower(spec, rank, rdv, executor="ray")


# ---- executors --------------------------------------------------------------------


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


def _master_store(host: str, timeout_s: float) -> dist.TCPStore:
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


class MpExecutor:
    """Followers as local processes (spawned: no fork of a process running torch and gRPC threads)."""

    name = "mp"

    def __init__(self) -> None:
        self._procs: list[tuple[int, multiprocessing.process.BaseProcess]] = []

    def advertise_host(self) -> str:
        return "127.0.0.1"

    def launch(self, spec: WorkerSpec, rdv: Rendezvous) -> None:
        ctx = multiprocessing.get_context("spawn")
        procs: list[tuple[int, multiprocessing.process.BaseProcess]] = []
        for rank in range(1, spec.tp):
            p = ctx.Process(target=run_follower, args=(spec, rank, rdv, "mp"), name=f"specd-tp-rank{rank}", daemon=True)
            p.start()
            procs.append((rank, p))
        self._procs = procs

    def dead(self) -> str | None:
        for rank, p in list(self._procs):
            if p.exitcode is not None:
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def wait_death(self, timeout_s: float) -> str | None:
        procs = list(self._procs)
        if procs:
            multiprocessing.connection.wait([p.sentinel for _, p in procs], timeout_s)
        else:
            time.sleep(timeout_s)
        return self.dead()

    def hint(self) -> str:
        return "the worker processes are still loading the model; their log lines are above"

    def stop(self, grace_s: float) -> None:
        procs, self._procs = self._procs, []
        deadline = time.monotonic() + grace_s
        for _, p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for _, p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5.0)

    def close(self) -> None:
        self.stop(0.0)


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


def make_executor(kind: str, *, ray_address: str = "", gpu: bool = False) -> Executor:
    if kind == "mp":
        return MpExecutor()
    if kind == "ray":
        return RayExecutor(ray_address, gpu=gpu)
    raise FailedPrecondition(f"unknown executor {kind!r}; use mp or ray")


# ---- rank 0 ---------------------------------------------------------------------------


class WorkerGroup:
    """Rank 0's side of the group: forms it, sends commands, watches it, restarts it.

    Thread model: the model thread sends commands and runs forwards inside
    `collective()` (holding `_lock`); a monitor thread per generation waits for
    follower deaths; one supervisor thread rebuilds the group after a failure.
    """

    READY, FAILED, STARTING, CLOSED = "ready", "failed", "starting", "closed"

    def __init__(self, spec: WorkerSpec, executor: Executor, *, exit_on_failure: bool = False) -> None:
        self.spec = spec
        self.executor = executor
        self.exit_on_failure = exit_on_failure
        self.state = self.STARTING
        self.generation = 0
        self.workers: list[dict[str, Any]] = []  # ready info of ranks 1..N-1 (pid, bytes, device)
        self.restarts = 0
        self.on_health: Callable[[bool], None] | None = None  # called from the supervisor thread
        self.on_fatal: Callable[[str], None] | None = None  # must end the process
        self._reason = ""
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._closing = threading.Event()
        self._commands: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._monitor_stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------

    def start(self, while_loading: Callable[[], None] | None = None) -> None:
        """Launch the followers, run `while_loading` (rank 0's own load), wait for all; raise on failure."""
        try:
            self._form(while_loading)
        except BaseException:
            self._teardown()
            self.executor.close()
            self.state = self.CLOSED
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="specd-tp-supervisor", daemon=True)
        self._supervisor.start()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the followers (politely, then by force) and free the process group."""
        if self.state == self.CLOSED:
            return
        self._closing.set()
        self._failed.set()  # wake the supervisor so it can exit
        if self._lock.acquire(timeout=grace_s):
            try:
                if self.state == self.READY and self._commands is not None:
                    try:
                        dist.broadcast_object_list([("stop",)], src=0, group=self._commands)
                    except Exception as exc:  # noqa: BLE001 - followers may be gone
                        log.debug("stop command: %s", exc)
                self.state = self.CLOSED
                self._teardown(grace_s)
            finally:
                self._lock.release()
        else:
            self.state = self.CLOSED
            self.executor.stop(0.0)
        self.executor.close()

    def fail(self, reason: str, generation: int | None = None) -> None:
        """Mark the group failed (any thread); the supervisor restarts it. Stale reports are ignored."""
        if generation is not None and generation != self.generation:
            return
        if self.state != self.READY:
            return
        self._reason = reason
        self.state = self.FAILED
        log.error("tensor-parallel worker group failed: %s", reason)
        self._failed.set()

    # ---- the model thread ---------------------------------------------------------------

    def unavailable(self) -> Unavailable:
        if self.state == self.CLOSED:
            return Unavailable("the target is shutting down")
        return Unavailable(f"the tensor-parallel worker group is restarting ({self._reason}); retry shortly")

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Run rank 0's side of a command + forward; any failure fails the group and raises Unavailable."""
        if self.state != self.READY:
            raise self.unavailable()
        with self._lock:
            if self.state != self.READY:
                raise self.unavailable()
            generation = self.generation
            try:
                yield
            except BaseException as exc:
                # The followers may be mid-forward: the group is out of step either way.
                first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
                self.fail(f"rank 0: {type(exc).__name__}: {first_line}", generation)
                raise self.unavailable() from exc

    def send(self, command: tuple[Any, ...]) -> None:
        """Broadcast one command to the followers (call inside `collective()`)."""
        dist.broadcast_object_list([command], src=0, group=self._commands)

    # ---- forming and restarting -----------------------------------------------------

    def _form(self, while_loading: Callable[[], None] | None = None) -> None:
        spec = self.spec
        generation = self.generation + 1
        store = _master_store(self.executor.advertise_host(), spec.ready_timeout_s)
        rdv = Rendezvous(self.executor.advertise_host(), store.port, generation)
        log.info(
            "starting %d tensor-parallel workers (%s executor, generation %d)",
            spec.tp - 1,
            self.executor.name,
            generation,
        )
        self.executor.launch(spec, rdv)
        deadline = time.monotonic() + spec.ready_timeout_s
        if while_loading is not None:
            while_loading()
        workers = self._wait_ready(store, deadline)
        commands = _init_groups(spec, store, 0)
        self._store, self._commands, self.workers = store, commands, workers
        self.generation = generation
        self._monitor_stop = threading.Event()
        threading.Thread(
            target=self._monitor,
            args=(generation, self._monitor_stop),
            name=f"specd-tp-monitor-{generation}",
            daemon=True,
        ).start()
        self.state = self.READY
        for w in workers:
            log.info(
                "tp worker rank %d ready: pid %d on %s (%s), %d bytes of sharded weights",
                w["rank"],
                w["pid"],
                w["host"],
                w["device"],
                w["sharded_bytes"],
            )

    def _wait_ready(self, store: dist.TCPStore, deadline: float) -> list[dict[str, Any]]:
        pending = set(range(1, self.spec.tp))
        ready: dict[int, dict[str, Any]] = {}

        def check_errors() -> None:
            for rank in sorted(pending):
                if store.check([f"error/{rank}"]):
                    raise FailedPrecondition(
                        f"tensor-parallel rank {rank} could not load its shard: {store.get(f'error/{rank}').decode()}"
                    )

        while pending:
            check_errors()
            for rank in sorted(pending):
                if store.check([f"ready/{rank}"]):
                    ready[rank] = json.loads(store.get(f"ready/{rank}"))
                    pending.discard(rank)
            if not pending:
                break
            why = self.executor.dead()
            if why is not None:
                check_errors()
                raise Unavailable(f"tensor-parallel worker {why} before it was ready; see its log")
            if time.monotonic() > deadline or self._closing.is_set():
                raise Unavailable(
                    f"tensor-parallel ranks {sorted(pending)} were not ready after {self.spec.ready_timeout_s:.0f} s: "
                    f"{self.executor.hint()}; raise --worker-ready-timeout-s if loading is only slow"
                )
            time.sleep(0.05)
        return [ready[r] for r in sorted(ready)]

    def _teardown(self, grace_s: float = 0.0) -> None:
        self._monitor_stop.set()
        self.executor.stop(grace_s)
        _destroy_groups()
        self._commands, self._store = None, None

    def _monitor(self, generation: int, stop: threading.Event) -> None:
        while not stop.is_set():
            why = self.executor.wait_death(0.5)
            if why is not None and not stop.is_set():
                self.fail(why, generation)
                return

    def _health(self, serving: bool) -> None:
        if self.on_health is not None:
            try:
                self.on_health(serving)
            except Exception:
                log.exception("health callback failed")

    def _supervise(self) -> None:
        while True:
            self._failed.wait()
            if self._closing.is_set():
                return
            self._health(False)
            with self._lock:  # waits for the model thread's failing call to return
                self._teardown()
            if self.exit_on_failure:
                log.critical(
                    "tensor-parallel worker failed (%s); exiting for a restart (--exit-on-worker-failure)", self._reason
                )
                if self.on_fatal is not None:
                    self.on_fatal(self._reason)
                else:
                    os._exit(EXIT_WORKER_FAILURE)
                return
            pause = _RESTART_BACKOFF_S[0]
            while not self._closing.is_set():
                try:
                    self._failed.clear()
                    with self._lock:
                        self._form()
                    break
                except Exception as exc:  # noqa: BLE001 - retried with backoff; health stays NOT_SERVING
                    log.error("restarting the tensor-parallel workers failed: %s; retrying in %.0f s", exc, pause)
                    with self._lock:
                        self._teardown()
                    self._closing.wait(pause)
                    pause = min(pause * 2, _RESTART_BACKOFF_S[1])
            if self._closing.is_set():
                return
            self.restarts += 1
            log.info("tensor-parallel worker group restarted (generation %d)", self.generation)
            self._health(True)


# ---- the runner on rank 0 ----------------------------------------------------------------


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
            self.group.send(("forward", s.tp_id, start, s.tokens[start:], num_last))
            return super().logits(s, num_last)

    def logits_batch(self, sessions: Sequence[KVSession], num_last: Sequence[int]) -> list[torch.Tensor]:
        """One batched forward on every rank: the followers get the sessions' (start, new tokens) in
        order and run the same `CausalLMRunner.logits_batch`, so the padded shapes, and with them the
        collectives inside the model, match rank 0's."""
        pairs = self._check_batch(sessions, num_last)  # the same InvalidArgument as the batched runner
        if len(pairs) <= 1:
            return [self.logits(s, k) for s, k in pairs]  # one session: the plain forward command
        with self.group.collective():
            batch = []
            for s, k in pairs:
                assert isinstance(s, TPSession), "sessions of a TensorParallelRunner come from its new_session"
                if s.generation != self.group.generation:  # the followers restarted: they hold nothing
                    self._crop(s, 0)
                    s.generation = self.group.generation
                start = min(s.cached, len(s.tokens) - k)  # what CausalLMRunner.logits_batch will compute
                batch.append((s.tp_id, start, s.tokens[start:], k))
            self.group.send(("forward_batch", batch))
            return super().logits_batch([s for s, _ in pairs], [k for _, k in pairs])

    def release(self, s: KVSession) -> None:
        if not isinstance(s, TPSession) or s.generation != self.group.generation:
            return
        try:
            with self.group.collective():
                self.group.send(("release", [s.tp_id]))
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
