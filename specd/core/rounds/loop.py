"""The round loop: the one place a request's rounds run, whatever carries them.

`RoundLoop` is a service's (one per coordinator, shared by its requests: auto's
measurements, the draft's health, background closes); `loop.run(spec)` gives
a request's `RequestRun` (specd.core.rounds.request_run), whose rounds do, per
round (ARCHITECTURE §2): choose K (fixed, or adaptive from measured acceptance
and cost), take the draft tokens (a pipelined pre-draft made for exactly this
prefix, or a fresh propose), send them to the target, let the pipeline
strategy pre-draft the next round meanwhile, commit the verdict, apply the
stop rules, and emit one immutable `RoundRecord`.

It talks to a `DraftPort` and a `TargetPort` (specd.core.rounds.ports) and nothing
else: the coordinator plugs in gRPC adapters, the in-process oracle plugs in
a Drafter and a Verifier (specd.core.inprocess), tests plug in scripted fakes.

Exactness does not depend on the draft: a draft that fails, is slow, lies or
is missing turns the round target-only (the target samples the token
itself), and a pre-draft is used only when it was made for the committed
prefix (specd.core.rounds.pipeline). The target failing is retried within
`target_timeout_s` of the first failure or the deadline, then the request
fails with Unavailable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence

from specd.core.rounds.auto import AutoPolicy
from specd.core.rounds.branch_budget import BranchBudgets
from specd.core.rounds.port_sessions import DraftSession, TargetSession
from specd.core.rounds.ports import DraftPort, NoObserver, RoundObserver, TargetPort
from specd.core.rounds.request_run import RequestRun
from specd.core.rounds.spec import SPECULATION_MODES, GenerateSpec, LoopSettings
from specd.core.rounds.tree_rounds import StopCheck

__all__ = ["SPECULATION_MODES", "GenerateSpec", "LoopSettings", "RequestRun", "RoundLoop"]

log = logging.getLogger(__name__)


class RoundLoop:
    """Runs requests' rounds over two ports; one per service, shared by its requests.

    Shared: auto's service-wide measurements (cycles per arm, call costs,
    acceptance; specd.core.rounds.auto) and the draft's health (a failure
    pauses speculation for every request for draft_retry_s).
    """

    def __init__(self, target: TargetPort, draft: DraftPort | None, settings: LoopSettings | None = None) -> None:
        self.target = target
        self.draft = draft
        self.settings = settings or LoopSettings()
        self.auto = AutoPolicy()
        self.branch_budgets = BranchBudgets()  # spec-cache's measurements per workload class
        self.running = 0  # requests whose rounds are running (auto's workload class)
        self._draft_down_until = 0.0
        self._background: set[asyncio.Task[None]] = set()
        self._abandoned: set[asyncio.Task[None]] = set()  # the closes of requests that ended unfinished

    def run(
        self,
        spec: GenerateSpec,
        *,
        max_context: int,
        session_id: str,
        deadline: float = math.inf,
        stop: StopCheck | None = None,
        observer: RoundObserver | None = None,
    ) -> RequestRun:
        """A request ready to run (InvalidArgument now if it cannot); iterate its `rounds()`."""
        return RequestRun(self, spec, max_context, session_id, deadline, stop, observer or NoObserver())

    async def draft_usable(self) -> bool:
        if self.draft is None or time.monotonic() < self._draft_down_until:
            return False
        return await self.draft.available()

    def draft_failed(self, exc: BaseException) -> None:
        self._draft_down_until = time.monotonic() + self.settings.draft_retry_s
        log.warning(
            "draft failed (%s: %s); target-only for %.1f s", type(exc).__name__, exc, self.settings.draft_retry_s
        )

    def close_later(
        self,
        target: TargetSession | None,
        draft: DraftSession | None,
        committed: Sequence[int] = (),
        *,
        abandoned: bool = False,
    ) -> None:
        """Free a finished request's sessions without holding it up (or being cancelled with it).

        The draft's close carries the final committed tokens (a learning drafter indexes the answer).
        abandoned: the request ended unfinished (cancelled, expired, failed), so a peer may still
        hold queued work for it until the close arrives; `abandoned_closing` counts these."""

        async def close_one(session: TargetSession | DraftSession) -> None:
            try:
                if isinstance(session, DraftSession):
                    await session.close(self.settings.close_timeout_s, committed)
                else:
                    await session.close(self.settings.close_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the peer's idle expiry frees it anyway
                log.debug("closing session %s failed: %s", session.session_id, exc)

        async def close() -> None:
            # Both at once: each close also withdraws its session's queued work at that peer.
            await asyncio.gather(*(close_one(s) for s in (target, draft) if s is not None))

        task = asyncio.get_running_loop().create_task(close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if abandoned:
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)

    @property
    def abandoned_closing(self) -> int:
        """Unfinished requests whose closes a peer has not answered yet: work may still run there for them."""
        return len(self._abandoned)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for background session closes."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)
