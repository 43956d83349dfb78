"""Assembles the coordinator: peers + engine + servicer + shared gRPC plumbing."""

from __future__ import annotations

from transformers import AutoTokenizer

from coordinator.engine import RoundEngine
from coordinator.peers import GrpcDraft, GrpcTarget, open_channel
from coordinator.servicer import CoordinatorServicer
from specd.core import catalog
from specd.core.catalog import DEMO
from specd.serving.config import CoordinatorConfig
from specd.serving.metrics import CoordinatorMetrics
from specd.serving.security import BearerTokenInterceptor, channel_credentials, read_token
from specd.serving.server import ServiceHandle, build_server
from specd.serving.tracing import TRACING_OFF, Tracing
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def load_tokenizer(config: CoordinatorConfig):
    folder = catalog.target_folder(DEMO, config.cache_path) if config.tokenizer == DEMO else config.tokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


async def create_server(
    config: CoordinatorConfig,
    *,
    connect_timeout_s: float = 120.0,
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> tuple[ServiceHandle, RoundEngine]:
    """The coordinator, connected to its peers, bound (port 0 picks one) but not started."""
    creds = (
        channel_credentials(config.peer_tls_ca, config.peer_tls_cert, config.peer_tls_key)
        if config.peer_tls_ca
        else None
    )
    channels = [open_channel(config.target, creds, config.peer_tls_server_name)]
    draft = None
    if config.draft_address is not None:
        channels.append(open_channel(config.draft_address, creds, config.peer_tls_server_name))
        draft = GrpcDraft(channels[1])
    engine = RoundEngine(config, load_tokenizer(config), GrpcTarget(channels[0]), draft)
    engine.tracing = tracing or TRACING_OFF
    engine.metrics = metrics
    if metrics is not None:
        metrics.watch_requests(lambda: engine.active_requests)
    await engine.start(timeout_s=connect_timeout_s)
    servicer = CoordinatorServicer(engine)
    interceptors = [BearerTokenInterceptor(read_token(config.api_token_file))] if config.api_token_file else []
    server, port, health = build_server(
        config,
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors=interceptors,
    )

    async def close() -> None:
        await engine.stop()
        for channel in channels:
            await channel.close()

    return ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=close), engine
