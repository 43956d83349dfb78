"""Assembles the draft service: drafter + servicer + shared gRPC plumbing."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from draft_service.servicer import DraftServicer
from specd.core import catalog
from specd.core.catalog import NGRAM
from specd.core.drafting import Drafter, ModelDrafter, NgramDrafter
from specd.serving.config import DraftConfig
from specd.serving.load import SERVICE_NAME as LOAD_SERVICE_NAME
from specd.serving.load import LoadSource, add_load_service
from specd.serving.metrics import DraftMetrics
from specd.serving.server import ServiceHandle, build_server
from specd.serving.tracing import Tracing
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def build_drafter(config: DraftConfig) -> tuple[Drafter, common_pb2.ModelInfo]:
    """The drafter a config names, and the ModelInfo the service reports."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    if config.model == NGRAM:
        # The n-gram drafter only repeats tokens it has seen, so it fits any
        # target; it reports the target's token space.
        identity = catalog.token_space(catalog.target_folder(config.target_model, config.cache_path))
        info = common_pb2.ModelInfo(name="ngram", kind="ngram", **identity)
        drafter = NgramDrafter(
            int(identity["vocab_size"]),
            max_sessions=config.max_sessions,
            idle_timeout_s=config.idle_timeout_s,
            cap_at_match=config.ngram_cap_at_match,
        )
        return drafter, info
    folder = catalog.draft_folder(config.model, config.target_model, config.cache_path)
    # A draft folder may carry a reduced-vocabulary head (specd distill --vocab N): the
    # drafter then proposes among those N tokens only (q = 0 elsewhere, still exact).
    loaded, runner, token_map = catalog.load_draft_for_serving(folder, config.device)
    drafter = ModelDrafter(
        runner,
        max_sessions=config.max_sessions,
        wire_top_k=config.wire_top_k,
        wire_bits=config.wire_bits,
        idle_timeout_s=config.idle_timeout_s,
        token_map=token_map,
        max_kv_bytes=config.max_kv_bytes,
        max_batch=config.max_batch,
    )
    info = common_pb2.ModelInfo(kind="model", **catalog.model_identity(loaded, runner))
    return drafter, info


def create_server(
    config: DraftConfig,
    *,
    drafter: Drafter | None = None,
    info: common_pb2.ModelInfo | None = None,
    tracing: Tracing | None = None,
    metrics: DraftMetrics | None = None,
) -> ServiceHandle:
    """The draft service, bound (port 0 picks one) but not started."""
    if drafter is None or info is None:
        drafter, info = build_drafter(config)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-draft-model")
    servicer = DraftServicer(
        drafter,
        executor,
        info,
        config.max_draft_tokens,
        tracing=tracing,
        metrics=metrics,
        max_batch=config.max_batch,
        batch_wait_s=config.batch_wait_ms / 1e3,
    )
    load = LoadSource.of(drafter, servicer.batcher, config)

    def register(s: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftServicer_to_server(servicer, s)
        add_load_service(s, load)

    server, port, health = build_server(config, register, [SERVICE_NAME, LOAD_SERVICE_NAME])
    return ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=executor.shutdown)
