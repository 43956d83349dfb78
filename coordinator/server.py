"""Assembles the coordinator: peers + engine + servicer + shared gRPC plumbing (+ the OpenAI HTTP API)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from transformers import AutoTokenizer

from coordinator.discovery import Replica, parse_peer_address
from coordinator.engine import RoundEngine
from coordinator.http_server import OpenAIServer
from coordinator.peers import GrpcDraft, GrpcTarget, open_channel
from coordinator.replica_ports import ReplicatedDraft, ReplicatedTarget
from coordinator.replicas import ReplicaSet, SameModel
from coordinator.requests import public_message_limit
from coordinator.servicer import CoordinatorServicer
from specd.core.model import catalog
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.serving.reloading import ReloadingChannel, TokenFile
from specd.serving.replica_metrics import ReplicaCollector
from specd.serving.security import BearerTokenCheck, BearerTokenInterceptor, channel_credentials, read_token
from specd.serving.server import ServiceHandle, build_server
from specd.serving.tracing import TRACING_OFF, Tracing
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc, draft_pb2, target_pb2

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def load_tokenizer(config: CoordinatorConfig):
    """The tokenizer --tokenizer names: 'demo', 'sim:PROFILE' (an emulated model's) or a folder."""
    return AutoTokenizer.from_pretrained(
        catalog.target_folder(config.tokenizer, config.cache_path), local_files_only=True
    )


@dataclass
class Coordinator:
    """The assembled service: its gRPC server, its engine and, with --http-port, the HTTP API.

    `handle` stops both ports together: the HTTP port stops taking connections when the
    gRPC drain begins, and its requests in flight finish before the engine stops."""

    handle: ServiceHandle
    engine: RoundEngine
    openai: OpenAIServer | None = None


async def create_server(
    config: CoordinatorConfig,
    *,
    connect_timeout_s: float = 120.0,
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> tuple[ServiceHandle, RoundEngine]:
    """The coordinator, connected to its peers, bound (port 0 picks one) but not started."""
    service = await create_service(config, connect_timeout_s=connect_timeout_s, tracing=tracing, metrics=metrics)
    return service.handle, service.engine


async def create_service(
    config: CoordinatorConfig,
    *,
    connect_timeout_s: float = 120.0,
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> Coordinator:
    """create_server's, with the HTTP API (built, not started: `openai.start()` binds and serves it)."""

    def channel(replica: Replica) -> grpc.aio.Channel | ReloadingChannel:
        # A replica found by DNS is dialled by address but checked under the name it was found by.
        server_name = config.peer_tls_server_name or replica.authority
        if not config.peer_tls_ca:
            return open_channel(replica.address, None, server_name)
        # A new channel with the new client certificate whenever its files change.
        return ReloadingChannel(
            lambda: open_channel(
                replica.address,
                channel_credentials(config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key),
                server_name,
            ),
            [config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key],
        )

    def target_peer(ch: grpc.aio.Channel | ReloadingChannel, name: str) -> GrpcTarget:
        peer = GrpcTarget(ch)
        peer.stream.name = name
        return peer

    def draft_peer(ch: grpc.aio.Channel | ReloadingChannel, name: str) -> GrpcDraft:
        peer = GrpcDraft(ch)
        peer.stream.name = name
        peer.target_info = engine.target_info  # known before draft replicas are looked for
        return peer

    targets = ReplicaSet(
        "target",
        parse_peer_address(config.target),
        open_channel=channel,
        make_peer=target_peer,
        service_name=TARGET_SERVICE,
        check=SameModel(),
        poll_s=config.replica_poll_s,
        resolve_interval_s=config.resolve_interval_s,
    )
    drafts = (
        ReplicaSet(
            "draft",
            parse_peer_address(config.draft_address),
            open_channel=channel,
            make_peer=draft_peer,
            service_name=DRAFT_SERVICE,
            poll_s=config.replica_poll_s,
            resolve_interval_s=config.resolve_interval_s,
        )
        if config.draft_address is not None
        else None
    )
    if drafts is not None:  # a draft replica's sessions verify on one target replica where load allows
        targets.placement.pair(drafts.placement)
    engine = RoundEngine(
        config,
        load_tokenizer(config),
        ReplicatedTarget(targets),
        ReplicatedDraft(drafts) if drafts is not None else None,
    )
    engine.tracing = tracing or TRACING_OFF
    engine.metrics = metrics
    if metrics is not None:
        metrics.watch_requests(lambda: engine.active_requests)
        sets = [s for s in (targets, drafts) if s is not None]
        metrics.registry.register(ReplicaCollector(lambda: [(s.role, s.describe(), s.moves) for s in sets]))
    await engine.start(timeout_s=connect_timeout_s)
    servicer = CoordinatorServicer(engine)
    interceptors = []
    tokens = None
    if config.api_token_file:  # re-read when the file changes; the previous token stays valid for a grace period
        tokens = BearerTokenCheck(TokenFile(config.api_token_file, read_token, grace_s=config.api_token_grace_s))
        interceptors.append(BearerTokenInterceptor(tokens))  # one check for both ports
    server, port, health = build_server(
        config,
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors=interceptors,
        max_message_bytes=public_message_limit(config, engine.max_context),
    )

    openai = OpenAIServer(engine, config, tokens) if config.http_port >= 0 else None

    async def close() -> None:
        if openai is not None:
            await openai.stop()  # its requests in flight finish (within --grace-s) on the engine
        await engine.stop()  # closes every replica's stream and channel

    handle = ServiceHandle(
        server,
        port,
        health,
        [SERVICE_NAME],
        on_stop=close,
        on_drain=openai.begin_shutdown if openai is not None else None,
    )
    return Coordinator(handle, engine, openai)
