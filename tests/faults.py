"""Fault injection for the tests: drafts that lie or stall, served by a real in-process draft server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.server import create_server
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.protocol import propose_each
from specd.core.model import catalog
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.serving.config import DraftConfig
from specd.v1 import common_pb2


@dataclass
class LyingDrafter:
    """A real drafter whose answers are corrupted in turn: ids out of range, bad q, too many tokens."""

    inner: ModelDrafter
    calls: int = 0

    @property
    def kind(self) -> str:
        return "model"

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = "",
        confidence: bool = True,
    ) -> None:
        self.inner.open(session_id, token_ids, params, wire_top_k, tenant, confidence)

    def close(self, session_id: str) -> None:
        self.inner.close(session_id)

    def active_sessions(self) -> int:
        return self.inner.active_sessions()

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """One by one through propose(), so each answer gets its turn of lying (or stalling)."""
        return propose_each(self.propose, requests)

    def propose(self, request: ProposeRequest) -> Proposal:
        real = self.inner.propose(request)
        self.calls += 1
        lie = self.calls % 5
        k = len(real.token_ids)
        if lie == 0:
            return real  # every fifth answer is honest
        if lie == 1:  # a token outside the vocabulary
            return Proposal([self.vocab_size + 7] * k, compute_ms=real.compute_ms)
        if lie == 2:  # more tokens than asked
            return Proposal(real.token_ids * 3 + [0], compute_ms=real.compute_ms)
        if lie == 3:  # q that does not contain the proposed token
            ids = torch.full((k, 1), (real.token_ids[0] + 1) % self.vocab_size, dtype=torch.int64)
            return Proposal(real.token_ids, ids, torch.ones(k, 1), real.compute_ms)
        ids = torch.tensor([[t] for t in real.token_ids], dtype=torch.int64)  # negative probabilities
        return Proposal(real.token_ids, ids, -torch.ones(k, 1), real.compute_ms)


@dataclass
class SlowDrafter(LyingDrafter):
    """Honest but slower than the coordinator's draft timeout every other call."""

    delay_s: float = 4.0

    def propose(self, request: ProposeRequest) -> Proposal:
        self.calls += 1
        if self.calls % 2:
            time.sleep(self.delay_s)
        return self.inner.propose(request)


class InProcessDraftServer:
    """A draft gRPC server in a background thread of the test process."""

    def __init__(self, drafter_cls: type[LyingDrafter], draft_folder: Path, **kwargs: object) -> None:
        loaded, runner = catalog.load_for_serving(draft_folder, "cpu")
        self.drafter = drafter_cls(ModelDrafter(runner), **kwargs)  # type: ignore[arg-type]
        self.info = common_pb2.ModelInfo(kind="model", **catalog.model_identity(loaded, runner))
        self.address = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        handle = create_server(DraftConfig(port=0), drafter=self.drafter, info=self.info)  # type: ignore[arg-type]
        await handle.server.start()
        await handle.set_serving(True)
        self.address = f"127.0.0.1:{handle.port}"
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await handle.stop(0.5)

    def __enter__(self) -> InProcessDraftServer:
        self._thread.start()
        assert self._ready.wait(60), "in-process draft server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
