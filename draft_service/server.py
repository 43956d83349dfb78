"""Assembles the draft service: drafter + servicer + shared gRPC plumbing."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from draft_service.servicer import DraftServicer
from specd.core.draft.hybrid import HybridDrafter
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.protocol import Drafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.draft.tenant_index import TenantIndexes
from specd.core.model import catalog
from specd.core.model.catalog import MODEL_FREE_DRAFTS, SUFFIX
from specd.core.model.kv_memory import default_kv_budget
from specd.core.model.runner import CausalLMRunner
from specd.serving.config import DraftConfig
from specd.serving.cpu_threads import attach_thread_governor
from specd.serving.metrics import DraftMetrics
from specd.serving.replica_load import SERVICE_NAME as LOAD_SERVICE_NAME
from specd.serving.replica_load import LoadSource, add_load_service
from specd.serving.server import MAX_MESSAGE_BYTES, ServiceHandle, build_server, message_limit_for_context
from specd.serving.tracing import Tracing
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def build_drafter(config: DraftConfig) -> tuple[Drafter, common_pb2.ModelInfo]:
    """The drafter a config names, and the ModelInfo the service reports."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif catalog.is_sim(config.model):  # an emulated model's host work is small tensors: one thread
        torch.set_num_threads(1)
    if config.model in MODEL_FREE_DRAFTS:
        # The n-gram and suffix drafters only repeat tokens they have seen, so they fit any
        # target; they report the target's token space.
        space = catalog.token_space(catalog.target_folder(config.target_model, config.cache_path))
        info = common_pb2.ModelInfo(name=config.model, kind=config.model, **space)
        drafter: Drafter
        if config.model == SUFFIX:
            drafter = SuffixDrafter(
                space["vocab_size"],
                config.suffix_settings(),
                max_sessions=config.max_sessions,
                idle_timeout_s=config.idle_timeout_s,
            )
        else:
            drafter = NgramDrafter(
                space["vocab_size"],
                max_sessions=config.max_sessions,
                idle_timeout_s=config.idle_timeout_s,
                cap_at_match=config.ngram_cap_at_match,
            )
        return drafter, info
    hybrid = catalog.hybrid_model(config.model)
    base = hybrid or config.model
    if catalog.is_sim(base):  # an emulated accelerator: q from the profile, the real ModelDrafter
        sim_runner, identity = catalog.load_sim_for_serving(base, "draft", config.cache_path)
        model = _model_drafter(sim_runner, config, None)
    else:
        folder = catalog.draft_folder(base, config.target_model, config.cache_path)
        # A draft folder may carry a reduced-vocabulary head (specd distill --vocab N): the
        # drafter then proposes among those N tokens only (q = 0 elsewhere, still exact).
        loaded, runner, token_map = catalog.load_draft_for_serving(folder, config.device, cpu_linear=config.cpu_linear)
        attach_thread_governor(runner.model, config.torch_threads, config.device)
        model = _model_drafter(runner, config, token_map)
        identity = catalog.model_identity(loaded, runner)
    if hybrid is None:
        return model, common_pb2.ModelInfo(kind="model", **identity)
    hybrid_drafter = HybridDrafter(
        model,
        config.suffix_settings(),
        threshold=config.hybrid_threshold,
        adaptive_k=config.hybrid_adaptive_k,
        max_sessions=config.max_sessions,
        idle_timeout_s=config.idle_timeout_s,
    )
    identity["name"] = f"{catalog.HYBRID_PREFIX}{identity['name']}"
    return hybrid_drafter, common_pb2.ModelInfo(kind="hybrid", **identity)


def _model_drafter(runner: CausalLMRunner, config: DraftConfig, token_map: torch.Tensor | None) -> ModelDrafter:
    return ModelDrafter(
        runner,
        max_sessions=config.max_sessions,
        q=config.q_settings,
        idle_timeout_s=config.idle_timeout_s,
        token_map=token_map,
        encode_q=True,  # the wire's compact q rows, each step's encoded while the next step's pass runs
        max_kv_bytes=default_kv_budget(  # measured now, right after loading
            runner,
            config.max_kv_bytes,
            config.kv_memory_fraction,
            logit_rows=config.max_batch * (config.max_draft_tokens + 1),
        ),
        max_batch=config.max_batch,
    )


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
    learned = getattr(drafter, "learned", None)
    if metrics is not None and isinstance(learned, TenantIndexes):
        metrics.watch_suffix_index(learned)
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
    runner = getattr(drafter, "runner", None)  # a model drafter: its context bounds every message
    limit = message_limit_for_context(runner.max_context) if runner is not None else MAX_MESSAGE_BYTES
    load = LoadSource.of(drafter, servicer.batcher, config)

    def register(s: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftServicer_to_server(servicer, s)
        add_load_service(s, load)

    server, port, health = build_server(config, register, [SERVICE_NAME, LOAD_SERVICE_NAME], max_message_bytes=limit)
    return ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=executor.shutdown, on_drain=servicer.drain)
