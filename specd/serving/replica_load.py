"""The Load service: a draft or target replica reports how busy it is.

Coordinators that spread sessions over many replicas poll it (see
coordinator/replicas.py) and place each new session on the least-loaded
replica. The numbers are read from the model thread's structures without a
lock, so a read that races with a change reports the last good value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specd.serving.batching import MicroBatcher
from specd.serving.config import ModelServiceBase
from specd.v1 import load_pb2, load_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = load_pb2.DESCRIPTOR.services_by_name["Load"].full_name


@dataclass(frozen=True)
class LoadSource:
    """Where a replica's load comes from: callables over its drafter or verifier and its batcher."""

    sessions: Callable[[], int]
    queued: Callable[[], int]
    kv_bytes: Callable[[], int] | None = None
    max_sessions: int = 0
    max_kv_bytes: int = 0

    @classmethod
    def of(cls, core: Any, batcher: MicroBatcher[Any, Any], config: ModelServiceBase) -> LoadSource:
        """A drafter's or verifier's sessions and KV bytes (when it has them), its batcher's queue."""
        return cls(
            core.active_sessions,
            lambda: batcher.queued,
            getattr(core, "kv_bytes", None),
            max_sessions=config.max_sessions,
            max_kv_bytes=config.max_kv_bytes,
        )


class LoadServicer(load_pb2_grpc.LoadServicer):
    def __init__(self, source: LoadSource) -> None:
        self.source = source
        self._last = load_pb2.ReplicaLoad(max_sessions=source.max_sessions, max_kv_bytes=source.max_kv_bytes)

    def read(self) -> load_pb2.ReplicaLoad:
        load = load_pb2.ReplicaLoad(max_sessions=self.source.max_sessions, max_kv_bytes=self.source.max_kv_bytes)
        try:
            load.sessions = self.source.sessions()
            load.queued_steps = self.source.queued()
            load.kv_bytes = self.source.kv_bytes() if self.source.kv_bytes is not None else 0
        except Exception as exc:  # noqa: BLE001 - a session table changed while read: report the last good load
            log.debug("reading load failed (%s); reporting the last one", exc)
            return self._last
        self._last = load
        return load

    async def GetLoad(
        self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> load_pb2.ReplicaLoad:
        return self.read()


def add_load_service(server: grpc.aio.Server, source: LoadSource) -> None:
    load_pb2_grpc.add_LoadServicer_to_server(LoadServicer(source), server)
