"""The torch device that `device`-marked tests run on: SPECD_TEST_DEVICE, cpu unless set.

scripts/gpu_check.sh runs ``SPECD_TEST_DEVICE=cuda pytest -m device``: the runner, the
sampler and rejection, the chi-square cells and greedy parity through the services, on
the GPU, against references computed on the CPU where a test has one.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("SPECD_TEST_DEVICE") or "cpu")


def service_device_args() -> list[str]:
    """`--device` for a target or draft service started by a test (none on the CPU: its default)."""
    return [] if DEVICE.type == "cpu" else ["--device", str(DEVICE)]
