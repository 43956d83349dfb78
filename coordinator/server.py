"""Assembles the coordinator: peers + engine + servicer + shared gRPC plumbing."""

from __future__ import annotations

import grpc
from transformers import AutoTokenizer

from coordinator.engine import RoundEngine
from coordinator.peers import GrpcDraft, GrpcTarget, open_channel
from coordinator.requests import public_message_limit
from coordinator.servicer import CoordinatorServicer
from specd.core import catalog
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.serving.reloading import ReloadingChannel, TokenFile
from specd.serving.security import BearerTokenInterceptor, channel_credentials, read_token
from specd.serving.server import ServiceHandle, build_server
from specd.serving.tracing import TRACING_OFF, Tracing
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def load_tokenizer(config: CoordinatorConfig):
    """The tokenizer --tokenizer names: 'demo', 'sim:PROFILE' (an emulated model's) or a folder."""
    return AutoTokenizer.from_pretrained(
        catalog.target_folder(config.tokenizer, config.cache_path), local_files_only=True
    )


async def create_server(
    config: CoordinatorConfig,
    *,
    connect_timeout_s: float = 120.0,
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> tuple[ServiceHandle, RoundEngine]:
    """The coordinator, connected to its peers, bound (port 0 picks one) but not started."""

    def channel(address: str) -> grpc.aio.Channel | ReloadingChannel:
        if not config.peer_tls_ca:
            return open_channel(address)
        # A new channel with the new client certificate whenever its files change.
        return ReloadingChannel(
            lambda: open_channel(
                address,
                channel_credentials(config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key),
                config.peer_tls_server_name,
            ),
            [config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key],
        )

    channels = [channel(config.target)]
    draft = None
    if config.draft_address is not None:
        channels.append(channel(config.draft_address))
        draft = GrpcDraft(channels[1])  # type: ignore[arg-type]
    engine = RoundEngine(config, load_tokenizer(config), GrpcTarget(channels[0]), draft)  # type: ignore[arg-type]
    engine.tracing = tracing or TRACING_OFF
    engine.metrics = metrics
    if metrics is not None:
        metrics.watch_requests(lambda: engine.active_requests)
    await engine.start(timeout_s=connect_timeout_s)
    servicer = CoordinatorServicer(engine)
    interceptors = []
    if config.api_token_file:  # re-read when the file changes; the previous token stays valid for a grace period
        tokens = TokenFile(config.api_token_file, read_token, grace_s=config.api_token_grace_s)
        interceptors.append(BearerTokenInterceptor(tokens.valid))
    server, port, health = build_server(
        config,
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors=interceptors,
        max_message_bytes=public_message_limit(config, engine.max_context),
    )

    async def close() -> None:
        await engine.stop()
        for channel in channels:
            await channel.close()

    return ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=close), engine
