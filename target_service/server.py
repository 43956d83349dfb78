"""Assembles the target service: verifier + servicer + shared gRPC plumbing."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from specd import catalog
from specd.config import TargetConfig
from specd.serving import ServiceHandle, build_server
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from specd.verification import Verifier
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


def build_verifier(config: TargetConfig) -> tuple[Verifier, common_pb2.ModelInfo]:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    folder = catalog.target_folder(config.model, config.cache_path)
    loaded, runner = catalog.load_for_serving(folder, config.device)
    verifier = Verifier(runner, max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s)
    return verifier, common_pb2.ModelInfo(**catalog.model_identity(loaded, runner))


def create_server(
    config: TargetConfig, *, verifier: Verifier | None = None, info: common_pb2.ModelInfo | None = None
) -> ServiceHandle:
    """The target service, bound (port 0 picks one) but not started."""
    if verifier is None or info is None:
        verifier, info = build_verifier(config)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-target-model")
    servicer = TargetServicer(verifier, executor, info)
    server, port, health = build_server(
        config, lambda s: target_pb2_grpc.add_TargetServicer_to_server(servicer, s), [SERVICE_NAME]
    )
    return ServiceHandle(server, port, health, [SERVICE_NAME], on_stop=executor.shutdown)
