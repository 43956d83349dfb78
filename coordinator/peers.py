"""One long-lived bidirectional stream per peer service, shared by all sessions.

`PeerStream` multiplexes requests over the stream by request_id, reconnects
with backoff when it breaks, and fails the requests in flight at that moment
with Unavailable (their sessions heal by re-opening on the next stream).
`DraftPeer` and `TargetPeer` translate between the core's types and messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import grpc

from specd.core.errors import DeadlineExceeded, Unavailable
from specd.core.phases import PhaseLog
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.core.verification import VerifyOutcome
from specd.serving.grpc_errors import exception_from_session_error
from specd.serving.server import CHANNEL_OPTIONS
from specd.serving.wire import params_to_proto, proposal_from_proto, sparse_to_proto
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class _Message(Protocol):
    request_id: int
    session_id: str


Req = TypeVar("Req", bound=_Message)
Resp = TypeVar("Resp", bound=_Message)

_CLOSE = object()  # tells the outgoing iterator of a stream to end


class PeerStream(Generic[Req, Resp]):
    """Request/response over one bidi stream, matched by request_id."""

    def __init__(
        self,
        name: str,
        open_call: Callable[[AsyncIterator[Req]], Any],
        *,
        max_backoff_s: float = 2.0,
        max_outstanding: int = 4096,
    ) -> None:
        self.name = name
        self._open_call = open_call
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Resp]] = {}
        self._outbox: asyncio.Queue[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._max_backoff_s = max_backoff_s
        self._max_outstanding = max_outstanding
        self.generation = 0  # increments on every (re)connect; sessions are re-checked per generation
        self.last_error: str = ""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"peer-{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
            self._task = None
        self._fail_pending(f"{self.name} stream closed")

    async def request(self, msg: Req, timeout: float) -> Resp:
        """Send msg, wait for its response; Unavailable if the stream breaks, DeadlineExceeded on timeout."""
        self.start()
        if len(self._pending) >= self._max_outstanding:
            raise Unavailable(f"{self.name}: too many requests in flight")
        outbox = self._outbox
        if outbox is None or not self._connected.is_set():
            raise Unavailable(f"{self.name} is not connected ({self.last_error or 'connecting'})")
        msg.request_id = next(self._ids)
        future: asyncio.Future[Resp] = asyncio.get_running_loop().create_future()
        self._pending[msg.request_id] = future
        try:
            outbox.put_nowait(msg)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.name} did not answer within {timeout:.2f} s") from exc
        finally:
            self._pending.pop(msg.request_id, None)

    async def wait_connected(self, timeout: float) -> bool:
        self.start()
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
            return True
        except TimeoutError:
            return False

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def _fail_pending(self, why: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(why))
        self._pending.clear()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            outbox: asyncio.Queue[Any] = asyncio.Queue()
            call = None
            try:
                call = self._open_call(self._outgoing(outbox))
                await call.wait_for_connection()
                self._outbox = outbox
                self.generation += 1
                self._connected.set()
                backoff = 0.05
                log.info("%s stream connected", self.name)
                async for resp in call:
                    future = self._pending.get(resp.request_id)
                    if future is not None and not future.done():
                        future.set_result(resp)
                self.last_error = "stream ended by the peer"
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # noqa: BLE001 - any failure means reconnect
                self.last_error = repr(exc)
            finally:
                self._connected.clear()
                self._outbox = None
                outbox.put_nowait(_CLOSE)
            log.warning("%s stream down (%s); reconnecting in %.2f s", self.name, self.last_error, backoff)
            self._fail_pending(f"{self.name} stream broke: {self.last_error}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    @staticmethod
    async def _outgoing(outbox: asyncio.Queue[Any]) -> AsyncIterator[Any]:
        while (msg := await outbox.get()) is not _CLOSE:
            yield msg


class TargetPeer:
    """The target service as the round logic sees it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = target_pb2_grpc.TargetStub(channel)
        self.stream: PeerStream[target_pb2.TargetRequest, target_pb2.TargetResponse] = PeerStream(
            "target", self._stub.Rounds
        )

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)

    async def _call(self, req: target_pb2.TargetRequest, timeout: float) -> target_pb2.TargetResponse:
        resp = await self.stream.request(req, timeout)
        if resp.WhichOneof("result") == "error":
            raise exception_from_session_error(resp.error)
        return resp

    async def open(
        self,
        sid: str,
        tokens: Sequence[int],
        params: SamplingParams,
        timeout: float,
        trace: dict[str, str] | None = None,
    ) -> None:
        req = target_pb2.TargetRequest(session_id=sid, committed_length=len(tokens), trace_context=trace or {})
        req.open.token_ids.extend(tokens)
        req.open.sampling.CopyFrom(params_to_proto(params))
        await self._call(req, timeout)

    async def verify(
        self,
        sid: str,
        committed_length: int,
        proposal: Proposal,
        timeout: float,
        trace: dict[str, str] | None = None,
        defer_bonus: bool = False,
    ) -> VerifyOutcome:
        req = target_pb2.TargetRequest(session_id=sid, committed_length=committed_length, trace_context=trace or {})
        req.verify.start = committed_length  # the target rolls back any verdict we did not see
        req.verify.draft_token_ids.extend(proposal.token_ids)
        req.verify.q.extend(sparse_to_proto(proposal))
        req.verify.defer_bonus = defer_bonus
        resp = await self._call(req, timeout)
        v = resp.verdict
        deferred = v.kind == target_pb2.TOKEN_KIND_DEFERRED
        if deferred and (not defer_bonus or v.accepted != len(proposal) or not len(proposal)):
            raise Unavailable("the target deferred a bonus it was not asked to defer")  # a peer out of step: retry
        return VerifyOutcome(
            accepted=v.accepted,
            token_id=-1 if deferred else v.token_id,
            is_bonus=v.kind == target_pb2.TOKEN_KIND_BONUS,
            deferred=deferred,
            committed_length=resp.committed_length,
            compute_ms=v.compute_ms,
            phases=PhaseLog(batch_size=max(1, v.batch_size), batch_tokens=v.batch_tokens),
        )

    async def close_session(self, sid: str, timeout: float) -> None:
        req = target_pb2.TargetRequest(session_id=sid)
        req.close.SetInParent()
        await self._call(req, timeout)


class DraftPeer:
    """The draft service as the round logic sees it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = draft_pb2_grpc.DraftStub(channel)
        self.stream: PeerStream[draft_pb2.DraftRequest, draft_pb2.DraftResponse] = PeerStream(
            "draft", self._stub.Rounds
        )

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)

    async def _call(self, req: draft_pb2.DraftRequest, timeout: float) -> draft_pb2.DraftResponse:
        resp = await self.stream.request(req, timeout)
        if resp.WhichOneof("result") == "error":
            raise exception_from_session_error(resp.error)
        return resp

    async def open(
        self,
        sid: str,
        tokens: Sequence[int],
        params: SamplingParams,
        timeout: float,
        trace: dict[str, str] | None = None,
    ) -> None:
        req = draft_pb2.DraftRequest(session_id=sid, committed_length=len(tokens), trace_context=trace or {})
        req.open.token_ids.extend(tokens)
        req.open.sampling.CopyFrom(params_to_proto(params))
        await self._call(req, timeout)

    async def propose(
        self,
        sid: str,
        committed: Sequence[int],
        start: int,
        num_tokens: int,
        vocab_size: int,
        timeout: float,
        trace: dict[str, str] | None = None,
    ) -> Proposal:
        req = draft_pb2.DraftRequest(session_id=sid, committed_length=len(committed), trace_context=trace or {})
        req.propose.start = start
        req.propose.token_ids.extend(committed[start:])
        req.propose.num_tokens = num_tokens
        resp = await self._call(req, timeout)
        proposal = proposal_from_proto(resp.proposal, vocab_size)  # validates ids and q
        if len(proposal) > num_tokens:
            raise Unavailable(f"draft sent {len(proposal)} tokens for {num_tokens} asked")
        return proposal

    async def close_session(self, sid: str, timeout: float, committed: Sequence[int] = (), start: int = 0) -> None:
        """Forget the session; `committed` (the draft agreeing on its first `start`) lets a learning drafter
        index the whole answer."""
        req = draft_pb2.DraftRequest(session_id=sid, committed_length=len(committed))
        req.close.SetInParent()
        if committed:
            req.close.start = start
            req.close.token_ids.extend(committed[start:])
        await self._call(req, timeout)


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str = ""
) -> grpc.aio.Channel:
    """A channel to a peer; TLS when credentials are given (server_name overrides the checked name)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)
