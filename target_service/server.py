"""Assembles the target service: verifier + servicer + shared gRPC plumbing."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from specd.core.errors import InvalidArgument
from specd.core.model import catalog
from specd.core.model.kv_memory import default_kv_budget
from specd.core.model.runner import CausalLMRunner
from specd.core.target.verifier import Verifier
from specd.serving.config import TargetConfig
from specd.serving.cpu_budget import service_threads
from specd.serving.cpu_threads import attach_thread_governor
from specd.serving.metrics import TargetMetrics
from specd.serving.replica_load import SERVICE_NAME as LOAD_SERVICE_NAME
from specd.serving.replica_load import LoadSource, add_load_service
from specd.serving.server import ServiceHandle, build_server, message_limit_for_context
from specd.serving.tracing import Tracing
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.servicer import TargetServicer
from target_service.workers.group import EXIT_WORKER_FAILURE, WorkerGroup
from target_service.workers.tp_runner import build_tp_runner

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


def build_verifier(config: TargetConfig) -> tuple[Verifier, common_pb2.ModelInfo]:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif catalog.is_sim(config.model):  # an emulated model's host work is small tensors: one thread
        torch.set_num_threads(1)
    if catalog.is_sim(config.model):  # an emulated accelerator: the profile models its own parallelism
        if config.tp > 1:
            raise InvalidArgument(
                f"--tp {config.tp} with an emulated model: a sim profile already models its hardware "
                "(tensor parallelism included); use --tp 1"
            )
        sim_runner, identity = catalog.load_sim_for_serving(config.model, "target", config.cache_path)
        return _verifier(sim_runner, config), common_pb2.ModelInfo(**identity)
    folder = catalog.target_folder(config.model, config.cache_path)
    runner: CausalLMRunner
    if config.tp > 1:  # this process is rank 0 of a tensor-parallel group
        loaded, runner = build_tp_runner(
            folder,
            tp=config.tp,
            executor=config.executor,
            device=config.device,
            torch_threads=service_threads(config.torch_threads, config.tp),
            ray_address=config.ray_address,
            ready_timeout_s=config.worker_ready_timeout_s,
            exit_on_failure=config.exit_on_worker_failure,
        )
    else:
        loaded, runner = catalog.load_for_serving(folder, config.device, cpu_linear=config.cpu_linear)
        attach_thread_governor(runner.model, config.torch_threads, config.device)
    return _verifier(runner, config), common_pb2.ModelInfo(**catalog.model_identity(loaded, runner))


def _verifier(runner: CausalLMRunner, config: TargetConfig) -> Verifier:
    return Verifier(
        runner,
        max_sessions=config.max_sessions,
        idle_timeout_s=config.idle_timeout_s,
        max_kv_bytes=default_kv_budget(  # measured now, right after loading
            runner,
            config.max_kv_bytes,
            config.kv_memory_fraction,
            logit_rows=config.max_batch * (config.max_draft_tokens + 1),
        ),
        max_batch=config.max_batch,
        max_draft_tokens=config.max_draft_tokens,
        max_q_width=config.max_q_width,
    )


def create_server(
    config: TargetConfig,
    *,
    verifier: Verifier | None = None,
    info: common_pb2.ModelInfo | None = None,
    tracing: Tracing | None = None,
    metrics: TargetMetrics | None = None,
) -> ServiceHandle:
    """The target service, bound (port 0 picks one) but not started."""
    if verifier is None or info is None:
        verifier, info = build_verifier(config)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-target-model")
    servicer = TargetServicer(
        verifier,
        executor,
        info,
        tracing=tracing,
        metrics=metrics,
        max_batch=config.max_batch,
        batch_wait_s=config.batch_wait_ms / 1e3,
    )
    # A whole context of token IDs, or a verify's largest q (about 9 bytes an entry), fits.
    q_bytes = 10 * verifier.max_draft_tokens * verifier.max_q_width
    load = LoadSource.of(verifier, servicer.batcher, config)

    def register(s: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetServicer_to_server(servicer, s)
        add_load_service(s, load)

    server, port, health = build_server(
        config,
        register,
        [SERVICE_NAME, LOAD_SERVICE_NAME],
        max_message_bytes=message_limit_for_context(verifier.runner.max_context) + q_bytes,
    )
    handle = ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=executor.shutdown, on_drain=servicer.drain)
    return _follow_worker_group(handle, verifier)


def _follow_worker_group(handle: ServiceHandle, verifier: Verifier) -> ServiceHandle:
    """With tp > 1: health follows the worker group, and stopping the service stops its workers."""
    group = getattr(verifier.runner, "group", None)
    if not isinstance(group, WorkerGroup):
        return handle
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
        log.warning("target service built outside an event loop: health will not follow the tp workers")
    if loop is not None:
        running = loop
        pending: set[asyncio.Task[None]] = set()

        def on_health(serving: bool) -> None:  # from the group's supervisor thread
            asyncio.run_coroutine_threadsafe(handle.set_serving(serving), running)

        async def exit_for_restart() -> None:
            try:
                await handle.set_serving(False)
                await handle.server.stop(1.0)
            finally:
                os._exit(EXIT_WORKER_FAILURE)

        def on_fatal(_why: str) -> None:
            running.call_soon_threadsafe(lambda: pending.add(running.create_task(exit_for_restart())))

        group.on_health, group.on_fatal = on_health, on_fatal
    stop_model_thread = handle.on_stop

    async def stop() -> None:
        if stop_model_thread is not None:
            result = stop_model_thread()  # no forward in flight after this
            if inspect.isawaitable(result):
                await result
        await asyncio.to_thread(group.shutdown)

    handle.on_stop = stop
    return handle
