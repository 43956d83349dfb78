"""One long-lived bidirectional stream per peer replica, shared by all sessions on it.

`PeerStream` multiplexes requests over the stream by request_id, reconnects
with backoff when it breaks, and fails the requests in flight at that moment
with Unavailable (their sessions heal by re-opening on the next stream).
The requests made in one event-loop turn travel as one stream message, and
each response message answers many of them: under load the per-message cost
(serialisation calls, gRPC's completions, wake-ups) is paid once per turn, not
once per session.
`Peer` is a service on such a stream (generic in its two message types);
`GrpcDraft` and `GrpcTarget` speak the round loop's port operations
(specd.core.rounds.ports) to one replica; coordinator.replica_ports spreads the
sessions over every replica's. Messages are built and read by specd.serving.wire.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import grpc

from specd.core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ProposalRefused, Unavailable
from specd.core.rounds import steps
from specd.core.rounds.ports import Carrier
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.tree import DraftTree
from specd.serving import tree_wire, wire
from specd.serving.grpc_errors import exception_from_session_error
from specd.serving.server import CHANNEL_OPTIONS
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, session_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


class _Message(Protocol):
    request_id: int
    session_id: str


Req = TypeVar("Req", bound=_Message)
Resp = TypeVar("Resp", bound=_Message)

_CLOSE = object()  # tells the outgoing iterator of a stream to end


@dataclass(frozen=True)
class Answer(Generic[Resp]):
    """A response, with how long its round trip took and how long the caller took to resume (ms)."""

    response: Resp
    round_trip_ms: float  # sent -> read off the stream (this process's clock)
    wake_ms: float  # read off the stream -> the waiting caller resumed


class PeerStream(Generic[Req, Resp]):
    """Request/response over one bidi stream, matched by request_id; one stream message per loop turn."""

    def __init__(
        self,
        name: str,
        open_call: Callable[[AsyncIterator[Any]], Any],
        *,
        pack: Callable[[list[Req]], Any],
        unpack: Callable[[Any], Iterable[Resp]],
        max_backoff_s: float = 2.0,
        max_outstanding: int = 4096,
    ) -> None:
        self.name = name
        self._open_call = open_call
        self._pack = pack  # requests -> one stream message (DraftRequests, TargetRequests)
        self._unpack = unpack  # a stream message -> its responses
        self._turn: list[Req] = []  # requests made this loop turn, sent together at its end
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[Resp, int]]] = {}  # request_id -> (response, read at)
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

    async def request(self, msg: Req, timeout: float) -> Answer[Resp]:
        """Send msg, wait for its response; Unavailable if the stream breaks, DeadlineExceeded on timeout."""
        self.start()
        if len(self._pending) >= self._max_outstanding:
            raise Unavailable(f"{self.name}: too many requests in flight")
        outbox = self._outbox
        if outbox is None or not self._connected.is_set():
            raise Unavailable(f"{self.name} is not connected ({self.last_error or 'connecting'})")
        msg.request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Resp, int]] = loop.create_future()
        self._pending[msg.request_id] = future
        # A timer, not asyncio.wait_for: that wraps every call in a task of its own.
        expiry = loop.call_later(timeout, self._expire, future, timeout)
        sent = time.perf_counter_ns()
        if not self._turn:
            loop.call_soon(self._flush, outbox)
        self._turn.append(msg)
        try:
            resp, received = await future
        finally:
            expiry.cancel()
            self._pending.pop(msg.request_id, None)
        return Answer(resp, (received - sent) / 1e6, (time.perf_counter_ns() - received) / 1e6)

    def _flush(self, outbox: asyncio.Queue[Any]) -> None:
        """This turn's requests as one stream message (on a stream that broke meanwhile, they fail with it)."""
        turn, self._turn = self._turn, []
        if turn:
            outbox.put_nowait(self._pack(turn))

    def _expire(self, future: asyncio.Future[Any], timeout: float) -> None:
        if not future.done():
            future.set_exception(DeadlineExceeded(f"{self.name} did not answer within {timeout:.2f} s"))

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
                async for message in call:
                    received = time.perf_counter_ns()
                    for resp in self._unpack(message):
                        future = self._pending.get(resp.request_id)
                        if future is not None and not future.done():
                            future.set_result((resp, received))
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


class _RoundResponse(_Message, Protocol):
    error: session_pb2.SessionError

    def WhichOneof(self, oneof_group: Literal["result"]) -> str | None: ...


Resp_ = TypeVar("Resp_", bound=_RoundResponse)


class Peer(Generic[Req, Resp_]):
    """A draft or target service as the coordinator sees it: one round stream, sessions on it, model info.

    Parametrised by the service's two stream message types; `GrpcDraft` and
    `GrpcTarget` add the one operation each has of its own.
    """

    def __init__(
        self, name: str, channel: grpc.aio.Channel, stub_type: Any, request_type: type[Req], requests_type: Any
    ) -> None:
        self._stub = stub_type(channel)
        self._request_type: Any = request_type  # DraftRequest or TargetRequest (wire builds either)
        self.stream: PeerStream[Req, Resp_] = PeerStream(
            name, self._stub.Rounds, pack=lambda requests: requests_type(requests=requests), unpack=_responses_of
        )

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        return await self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout)

    async def call(self, req: Req, timeout: float) -> Answer[Resp_]:
        """Send one stream message; the peer's in-band SessionError is raised as its domain exception."""
        answer = await self.stream.request(req, timeout)
        if answer.response.WhichOneof("result") == "error":
            raise exception_from_session_error(answer.response.error)
        return answer

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        await self.call(wire.open_request(self._request_type, request, carrier), timeout)

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None:
        await self.call(wire.close_request(self._request_type, request), timeout)


class GrpcTarget(Peer[target_pb2.TargetRequest, target_pb2.TargetResponse]):
    """One target replica's round stream (the loop's TargetPort operations).

    The public edge validated the request, so a target that calls a round
    invalid is a precondition failure of the deployment, not the client's fault.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(
            "target", channel, target_pb2_grpc.TargetStub, target_pb2.TargetRequest, target_pb2.TargetRequests
        )
        # From its last GetModelInfo (a replica takes sessions only once checked): verdict tokens must be in it.
        self.vocab_size: int | None = None

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        info = await super().model_info(timeout)
        self.vocab_size = info.vocab_size
        return info

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        try:
            await super().open(request, timeout=timeout, carrier=carrier)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"the target refused a round: {exc}") from exc

    async def verify(self, request: steps.VerifyRequest, *, timeout: float, carrier: Carrier) -> steps.VerifyOutcome:
        try:
            answer = await self.call(wire.verify_request(request, carrier), timeout)
            response = answer.response
            return wire.verdict_from_proto(response, answer.round_trip_ms, answer.wake_ms, vocab_size=self.vocab_size)
        except InvalidArgument as exc:
            # Everything else in a verify is the coordinator's own (checked) state, so a refused
            # round that carried a relayed q is the draft's: the loop verifies again without it.
            if request.proposal.wire_q is not None:
                raise ProposalRefused(f"the target refused the draft's proposal: {exc}") from exc
            raise FailedPrecondition(f"the target refused a round: {exc}") from exc

    async def stage(self, request: steps.StageRequest, *, timeout: float, carrier: Carrier) -> steps.StagedOutcome:
        """Stage the next round's verify; the answer comes once the target's verdict on this round decided it."""
        try:
            answer = await self.call(wire.stage_request(request, carrier), timeout)
        except InvalidArgument as exc:  # a relayed q the target refused: the draft's, as in verify
            raise ProposalRefused(f"the target refused a staged proposal: {exc}") from exc
        return wire.staged_outcome_from_proto(
            answer.response, request, answer.round_trip_ms, answer.wake_ms, vocab_size=self.vocab_size
        )

    async def verify_tree(
        self, request: steps.TreeVerifyRequest, *, timeout: float, carrier: Carrier
    ) -> steps.TreeVerifyOutcome:
        # The coordinator validated the draft's tree (tree_wire.draft_tree_from_proto) before sending it,
        # so a refusal is the deployment's (limits that do not fit), as for a chain without relayed q.
        try:
            answer = await self.call(tree_wire.verify_tree_request(request, carrier), timeout)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"the target refused a tree round: {exc}") from exc
        return tree_wire.tree_verdict_from_proto(answer.response, request.tree, self.vocab_size)


def _responses_of(message: Any) -> Any:
    """The responses a stream message carries (DraftResponses, TargetResponses)."""
    return message.responses


def compatibility_problem(target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo) -> str | None:
    """Why a draft cannot speculate for this target, or None if it can."""
    if draft.tokenizer_size != target.tokenizer_size:
        return f"tokenizer sizes differ (draft {draft.tokenizer_size}, target {target.tokenizer_size})"
    if draft.vocab_hash != target.vocab_hash:
        return "token-to-ID maps or special tokens differ (vocab_hash mismatch)"
    if draft.vocab_size > target.vocab_size:
        return f"draft vocabulary ({draft.vocab_size}) is larger than the target's ({target.vocab_size})"
    return None


class GrpcDraft(Peer[draft_pb2.DraftRequest, draft_pb2.DraftResponse]):
    """One draft replica's round stream: open, propose, close.

    Whether it may draft (stream up, token space matching the target's, checked
    once per stream generation) is the replica set's business
    (coordinator/replicas.py); the loop's DraftPort is coordinator.replica_ports.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__("draft", channel, draft_pb2_grpc.DraftStub, draft_pb2.DraftRequest, draft_pb2.DraftRequests)
        self.target_info: common_pb2.ModelInfo | None = None  # set before it drafts: ids are checked against it

    async def propose(self, request: steps.ProposeRequest, *, timeout: float, carrier: Carrier) -> Proposal:
        assert self.target_info is not None, "target_info first"
        answer = await self.call(wire.propose_request(request, carrier), timeout)
        # Checks the ids against the target's vocabulary; q goes on to the target undecoded (it checks it).
        return wire.proposal_from_answer(
            answer.response, self.target_info.vocab_size, answer.round_trip_ms, answer.wake_ms, relay=True
        )

    async def propose_branches(
        self, request: steps.BranchRequest, *, timeout: float, carrier: Carrier
    ) -> steps.Branches:
        assert self.target_info is not None, "target_info first"
        answer = await self.call(wire.branches_request(request, carrier), timeout)
        # Checks the ids; each branch's q goes on to the target undecoded.
        return wire.branches_from_proto(answer.response.branches, self.target_info.vocab_size, relay=True)

    async def propose_tree(self, request: steps.TreeProposeRequest, *, timeout: float, carrier: Carrier) -> DraftTree:
        assert self.target_info is not None, "target_info first"
        answer = await self.call(tree_wire.tree_propose_request(request, carrier), timeout)
        # Checks the ids against the target's vocabulary, the request's budget and depth; q goes on to
        # the target undecoded.
        return tree_wire.draft_tree_from_proto(
            answer.response.tree, self.target_info.vocab_size, budget=request.budget, depth=request.depth
        )

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None:
        await self.call(wire.draft_close_request(request), timeout)


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str = ""
) -> grpc.aio.Channel:
    """A channel to a peer; TLS when credentials are given (server_name overrides the checked name)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)
