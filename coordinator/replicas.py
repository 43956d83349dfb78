"""Every replica of one peer service (draft or target): a stream to each, their health and load.

`ReplicaSet` follows its Discovery: a replica that appears gets a channel,
its own round stream (the peer object) and a poll task; one that leaves
DNS retires: it takes no new session and is closed once this coordinator's
sessions on it have ended (or its stream is down).

The poll task asks the replica every `poll_s` seconds for its gRPC health
(NOT_SERVING: draining, no new sessions) and its load (the Load service),
and checks its model once per stream generation (`check`: a replica whose
model does not fit gets no sessions). A replica is *usable* for new
sessions when its stream is connected, it reports SERVING and its model
fits. Sessions stay on their replica while its stream is up, usable or not,
so a draining replica's sessions run to their end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.discovery import Discovery, PeerAddress, Replica, Resolve, resolve_all
from coordinator.placement import Load, Placement
from specd.core.errors import Unavailable
from specd.v1 import common_pb2, load_pb2, load_pb2_grpc

log = logging.getLogger(__name__)

ROLES = ("draft", "target")

Check = Callable[[common_pb2.ModelInfo], str | None]  # why a replica's model does not fit, or None
UNANSWERED_LIMIT = 3  # health checks timed out in a row before a connected replica counts as lost


class _Stream(Protocol):
    generation: int
    last_error: str

    @property
    def connected(self) -> bool: ...

    def start(self) -> None: ...

    async def wait_connected(self, timeout: float) -> bool: ...

    async def close(self) -> None: ...


class StreamPeer(Protocol):
    """A draft or target peer over one round stream (coordinator.peers)."""

    @property
    def stream(self) -> _Stream: ...

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo: ...


P = TypeVar("P", bound=StreamPeer)


@dataclass
class Member(Generic[P]):
    """One replica as this coordinator sees it."""

    replica: Replica
    channel: grpc.aio.Channel
    peer: P
    serving: bool | None = None  # gRPC health; None until the first answer
    retiring: bool = False  # gone from discovery: no new sessions, closed when its sessions end
    info: common_pb2.ModelInfo | None = None
    problem: str = "not checked yet"  # why its model does not fit ("" when it does)
    checked_generation: int = -1
    load_supported: bool = True
    unanswered: int = 0  # health checks in a row that timed out while the stream looked up
    polls: int = 0  # health/load/model rounds done
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.replica.name

    @property
    def connected(self) -> bool:
        return self.peer.stream.connected

    @property
    def usable(self) -> bool:
        """May take new sessions."""
        return self.connected and self.serving is True and not self.retiring and self.problem == ""

    @property
    def state(self) -> str:
        """One word for logs and metrics: serving | draining | retiring | unfit | down | starting."""
        if not self.connected:
            return "down"
        if self.retiring:
            return "retiring"
        if self.problem:
            return "unfit" if self.checked_generation >= 0 else "starting"
        if self.serving is None:
            return "starting"
        return "serving" if self.serving else "draining"


def model_mismatch(reference: common_pb2.ModelInfo, info: common_pb2.ModelInfo) -> str | None:
    """Why a target replica's model differs from the others' (a session must get the same p anywhere)."""
    for name in ("vocab_size", "tokenizer_size", "vocab_hash", "max_context"):
        if getattr(info, name) != getattr(reference, name):
            return f"its {name} ({getattr(info, name)}) differs from the other replicas' ({getattr(reference, name)})"
    if list(info.eos_token_ids) != list(reference.eos_token_ids):
        return "its end-of-sequence tokens differ from the other replicas'"
    return None


class SameModel:
    """A Check for target replicas: the first one checked sets the model the others must match."""

    def __init__(self) -> None:
        self.reference: common_pb2.ModelInfo | None = None

    def __call__(self, info: common_pb2.ModelInfo) -> str | None:
        if self.reference is None:
            self.reference = info
            return None
        return model_mismatch(self.reference, info)


class ReplicaSet(Generic[P]):
    """The replicas of one role, the streams to them and where each session lives."""

    def __init__(
        self,
        role: str,
        address: PeerAddress,
        *,
        open_channel: Callable[[Replica], grpc.aio.Channel],
        make_peer: Callable[[grpc.aio.Channel, str], P],
        service_name: str,
        check: Check | None = None,
        poll_s: float = 1.0,
        resolve_interval_s: float = 5.0,
        resolve: Resolve = resolve_all,
        placement: Placement | None = None,
    ) -> None:
        assert role in ROLES, role
        self.role = role
        self.service_name = service_name
        self.poll_s = poll_s
        self.placement = placement or Placement()
        self.members: dict[str, Member[P]] = {}
        self.moves = 0  # sessions re-opened on another replica than they were on
        self.placements: dict[str, int] = {}  # sessions opened per replica (new or moved)
        self._open_channel = open_channel
        self._make_peer = make_peer
        self._check = check
        self._closing: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self.discovery = Discovery(address, self._on_change, interval_s=resolve_interval_s, resolve=resolve)

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the address once and start a stream to every replica; then keep discovering."""
        await self.discovery.refresh()
        self.discovery.start()

    async def close(self) -> None:
        await self.discovery.close()
        for member in list(self.members.values()):
            await self._close_member(member)
        if self._closing:
            await asyncio.wait(self._closing, timeout=5.0)

    def set_check(self, check: Check) -> None:
        """Judge every replica's model with `check` from now on (each is re-checked at once)."""
        self._check = check
        for member in self.members.values():
            member.checked_generation, member.problem = -1, "not checked yet"

    async def wait_usable(self, timeout_s: float) -> bool:
        """Wait until some replica is usable (or timeout); True if one is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.usable_names():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, self.poll_s))
            except TimeoutError:
                pass
        return True

    async def wait_polled(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) until every known replica has been polled once, so that the first
        sessions are spread over all replicas that are up, not given to the first that answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(m.polls == 0 for m in self.members.values()):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, self.poll_s))
            except TimeoutError:
                pass

    # ---- sessions --------------------------------------------------------------------

    def usable_names(self) -> list[str]:
        return [n for n, m in self.members.items() if m.usable]

    def any_usable(self) -> bool:
        return any(m.usable for m in self.members.values())

    def place(self, session_id: str, exclude: Collection[str] = ()) -> tuple[Member[P], Member[P] | None]:
        """The replica to (re)open a session on: its own if usable, else the least-loaded usable one
        (among those that answered their last health check, while any did).

        Returns it and the connected replica the session leaves, if any (close it there).
        Unavailable when no replica is usable.
        """
        usable = self.usable_names()
        if not usable:
            raise self.no_replica_error()
        current = self.placement.where(session_id)
        if current not in usable or current in exclude:
            # a replica that missed its last health check (frozen, or its host gone silent) takes no
            # session while another answers: its stream is restarted only after UNANSWERED_LIMIT misses
            answering = [n for n in usable if self.members[n].unanswered == 0 and n not in exclude]
            usable = answering or usable
        name, left = self.placement.place(session_id, usable, exclude)
        if left == name:
            return self.members[name], None
        self.placements[name] = self.placements.get(name, 0) + 1
        if left is None:
            return self.members[name], None
        if not exclude:  # a retry after a refused open is no move: the session never lived there
            self.moves += 1
        log.info("%s session %s moves from %s to %s", self.role, session_id, left, name)
        old = self.members.get(left)
        if old is not None:
            self._retire_if_idle(old)
        return self.members[name], old if old is not None and old.connected else None

    def holder(self, session_id: str) -> Member[P] | None:
        """The replica the session lives on, if its stream is up (else it must be re-opened elsewhere)."""
        name = self.placement.where(session_id)
        member = self.members.get(name) if name is not None else None
        if member is None or not member.connected:
            return None
        return member

    def release(self, session_id: str) -> Member[P] | None:
        """The session ended: unpin it; returns its replica (to close it there) if still present."""
        name = self.placement.release(session_id)
        member = self.members.get(name) if name is not None else None
        if member is not None and member.retiring:
            self._retire_if_idle(member)
        return member

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's state, for logs and metrics."""
        out = []
        for name, m in sorted(self.members.items()):
            est = self.placement.estimate(name)
            out.append(
                {
                    "role": self.role,
                    "replica": name,
                    "state": m.state,
                    "sessions": self.placement.sessions_on(name),
                    "load": est[0],
                    "kv_bytes": est[1],
                    "placements": self.placements.get(name, 0),
                }
            )
        return out

    def no_replica_error(self) -> Unavailable:
        states = ", ".join(f"{n} {m.state}{f' ({m.problem})' if m.problem else ''}" for n, m in self.members.items())
        return Unavailable(f"no {self.role} replica can take a session ({states or 'none discovered'})")

    # ---- membership --------------------------------------------------------------------

    def _on_change(self, added: frozenset[Replica], removed: frozenset[Replica]) -> None:
        for replica in sorted(added):
            member = self.members.get(replica.name)
            if member is not None:  # came back before it was closed
                member.retiring = False
                continue
            channel = self._open_channel(replica)
            member = Member(replica, channel, self._make_peer(channel, f"{self.role} {replica.name}"))
            self.members[replica.name] = member
            self.placement.add(replica.name)
            member.peer.stream.start()
            member.task = asyncio.get_running_loop().create_task(self._watch(member), name=f"replica-{replica.name}")
            log.info("%s replica %s added", self.role, replica.name)
        for replica in sorted(removed):
            member = self.members.get(replica.name)
            if member is not None:
                member.retiring = True
                log.info("%s replica %s left discovery; retiring", self.role, replica.name)
                self._retire_if_idle(member)
        self._changed.set()

    def _retire_if_idle(self, member: Member[P]) -> None:
        """Close a retiring replica as soon as it holds none of our sessions (or its stream is down)."""
        if member.retiring and (self.placement.sessions_on(member.name) == 0 or not member.connected):
            task = asyncio.get_running_loop().create_task(self._close_member(member))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close_member(self, member: Member[P]) -> None:
        if self.members.get(member.name) is not member:
            return
        del self.members[member.name]
        moved = self.placement.remove(member.name)
        if moved:
            log.info("%s replica %s closed; %d sessions move when next used", self.role, member.name, len(moved))
        if member.task is not None and member.task is not asyncio.current_task():
            member.task.cancel()
        await member.peer.stream.close()
        await member.channel.close()
        self._changed.set()

    # ---- watching one replica ----------------------------------------------------------

    async def _watch(self, member: Member[P]) -> None:
        health = health_pb2_grpc.HealthStub(member.channel)
        load = load_pb2_grpc.LoadStub(member.channel)
        timeout = max(2.0, 2 * self.poll_s)  # generous: a busy replica is slow, not lost
        await member.peer.stream.wait_connected(timeout)  # a new replica's first poll sees its stream up
        while True:
            before = member.usable
            await asyncio.gather(
                self._poll_health(member, health, timeout),
                self._poll_load(member, load, timeout),
            )
            if member.connected and member.checked_generation != member.peer.stream.generation:
                await self._check_model(member, timeout)
            member.polls += 1
            if member.usable != before:
                log.info("%s replica %s is %s", self.role, member.name, member.state)
            if member.usable != before or member.polls == 1:
                self._changed.set()
            if member.retiring and (self.placement.sessions_on(member.name) == 0 or not member.connected):
                await self._close_member(member)
                return
            await asyncio.sleep(self.poll_s)

    async def _poll_health(self, member: Member[P], stub: Any, timeout: float) -> None:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=self.service_name), timeout=timeout)
            member.serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            member.unanswered = 0
            return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        if code == grpc.StatusCode.UNIMPLEMENTED:  # no health service: the stream decides
            member.serving, member.unanswered = True, 0
        elif code == grpc.StatusCode.NOT_FOUND:  # the service has not declared itself yet
            member.serving, member.unanswered = False, 0
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and member.connected:
            # Connected but silent (frozen, or its host gone without a reset): after a few misses,
            # restart the stream, which fails the calls waiting on it so their sessions move.
            member.unanswered += 1
            if member.unanswered >= UNANSWERED_LIMIT:
                log.warning(
                    "%s replica %s has not answered %d health checks; restarting its stream",
                    self.role,
                    member.name,
                    member.unanswered,
                )
                member.unanswered = 0
                member.serving = None
                await member.peer.stream.close()
                member.peer.stream.start()
        # otherwise unreachable: keep the last answer; the stream's state decides

    async def _poll_load(self, member: Member[P], stub: Any, timeout: float) -> None:
        if not member.load_supported:
            return
        try:
            r = await stub.GetLoad(load_pb2.GetLoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older replica: place by our own counts
                member.load_supported = False
            return
        self.placement.report(member.name, Load(r.sessions, r.kv_bytes, r.queued_steps))

    async def _check_model(self, member: Member[P], timeout: float) -> None:
        generation = member.peer.stream.generation
        try:
            info = await member.peer.model_info(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - asked again next poll
            member.problem = f"GetModelInfo failed: {exc}"
            return
        member.info, member.checked_generation = info, generation
        problem = self._check(info) if self._check is not None else None
        if problem and problem != member.problem:
            log.error("%s replica %s (%r) gets no sessions: %s", self.role, member.name, info.name, problem)
        member.problem = problem or ""
