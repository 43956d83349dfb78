"""The round loop's TargetPort and DraftPort over every replica of a service.

A session is opened on the replica placement picks (coordinator/placement.py)
and every later call goes to that replica. When the replica is gone (its
stream broke, it was removed, it stopped answering), the call raises
SessionNotFound: the loop re-opens the session from its committed tokens
(specd.core.rounds.port_sessions), and the re-open lands on another replica. So a
lost replica costs its sessions one prefill each, never a request, and the
output is the same (every coin derives from the seed and the position).

An open that a replica refuses for lack of room (ResourceExhausted) or
cannot deliver because the replica just went away is tried on the next
least-loaded replica before it fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from coordinator.replicas import Member, ReplicaSet
from specd.core.errors import DeadlineExceeded, ResourceExhausted, SessionNotFound, Unavailable
from specd.core.rounds import steps
from specd.core.rounds.ports import Carrier
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.tree import DraftTree

log = logging.getLogger(__name__)

P = TypeVar("P")
T = TypeVar("T")


class _Replicated(Generic[P]):
    """Open / call / close of sessions pinned to the replicas of one ReplicaSet."""

    def __init__(self, replicas: ReplicaSet[Any]) -> None:
        self.replicas = replicas
        self._closing: set[asyncio.Task[None]] = set()

    def replica_of(self, session_id: str) -> str | None:
        """The replica the session is on (for spans and logs)."""
        return self.replicas.placement.where(session_id)

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        session_id = request.session_id
        refused: list[str] = []
        while True:
            member, left = self.replicas.place(session_id, exclude=refused)
            if left is not None:
                self._close_on(left, session_id)
            try:
                await member.peer.open(request, timeout=timeout, carrier=carrier)
                return
            except ResourceExhausted as exc:  # full: the next replica may have room
                why: BaseException = exc
            except (Unavailable, DeadlineExceeded) as exc:
                if member.connected:
                    raise
                why = exc  # it went away meanwhile
            refused.append(member.name)
            if not set(self.replicas.usable_names()) - set(refused):
                raise why
            log.info(
                "%s replica %s could not open %s (%s); trying another", self.replicas.role, member.name, session_id, why
            )

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None:
        """Forget the session on its replica; a draft's close hands it the final committed tokens
        (a suffix drafter indexes them)."""
        member = self.replicas.release(request.session_id)
        if member is not None and member.connected:
            await member.peer.close(request, timeout=timeout)

    async def _on_holder(self, session_id: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """call(peer) on the session's replica; SessionNotFound when that replica is (or just went) away."""
        member = self.replicas.holder(session_id)
        if member is None:
            raise SessionNotFound(f"{self.replicas.role} session {session_id}: its replica is gone; re-open it")
        try:
            return await call(member.peer)
        except (Unavailable, DeadlineExceeded) as exc:
            if member.connected and self.replicas.members.get(member.name) is member:
                raise
            raise SessionNotFound(
                f"{self.replicas.role} replica {member.name} went away with session {session_id}: {exc}"
            ) from exc

    def _close_on(self, member: Member[Any], session_id: str) -> None:
        """The session left a replica that is still up: free it there, in the background."""

        async def close() -> None:
            try:
                await member.peer.close(steps.CloseRequest(session_id), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - the replica's idle expiry frees it anyway
                log.debug("closing moved session %s on %s failed: %s", session_id, member.name, exc)

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


class ReplicatedTarget(_Replicated[Any]):
    """TargetPort over all target replicas."""

    async def verify(self, request: steps.VerifyRequest, *, timeout: float, carrier: Carrier) -> steps.VerifyOutcome:
        return await self._on_holder(
            request.session_id, lambda peer: peer.verify(request, timeout=timeout, carrier=carrier)
        )

    async def verify_tree(
        self, request: steps.TreeVerifyRequest, *, timeout: float, carrier: Carrier
    ) -> steps.TreeVerifyOutcome:
        return await self._on_holder(
            request.session_id, lambda peer: peer.verify_tree(request, timeout=timeout, carrier=carrier)
        )

    async def stage(self, request: steps.StageRequest, *, timeout: float, carrier: Carrier) -> steps.StagedOutcome:
        return await self._on_holder(
            request.session_id, lambda peer: peer.stage(request, timeout=timeout, carrier=carrier)
        )


class ReplicatedDraft(_Replicated[Any]):
    """DraftPort over all draft replicas: available while any may take a session."""

    async def available(self) -> bool:
        return self.replicas.any_usable()

    async def propose(self, request: steps.ProposeRequest, *, timeout: float, carrier: Carrier) -> Proposal:
        return await self._on_holder(
            request.session_id, lambda peer: peer.propose(request, timeout=timeout, carrier=carrier)
        )

    async def propose_branches(
        self, request: steps.BranchRequest, *, timeout: float, carrier: Carrier
    ) -> steps.Branches:
        return await self._on_holder(
            request.session_id, lambda peer: peer.propose_branches(request, timeout=timeout, carrier=carrier)
        )

    async def propose_tree(self, request: steps.TreeProposeRequest, *, timeout: float, carrier: Carrier) -> DraftTree:
        return await self._on_holder(
            request.session_id, lambda peer: peer.propose_tree(request, timeout=timeout, carrier=carrier)
        )
