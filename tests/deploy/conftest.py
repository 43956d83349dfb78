"""The deployment tier's fixtures: the tools, installed on first use, and the chart rendered once per values file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.k8s_common import (
    HADOLINT,
    HELM,
    KUBECTL,
    ROOT,
    TOOLS,
    VALUES,
    helm,
    load_all,
    template_args,
)


@pytest.fixture(scope="session")
def tools() -> Path:
    """helm, kubectl, hadolint and kubernetes-validate, installed on first use."""

    def present() -> bool:
        return (
            all(os.access(p, os.X_OK) for p in (HELM, KUBECTL, HADOLINT))
            and (TOOLS / "pylib" / "kubernetes_validate" / "__init__.py").is_file()
            and (TOOLS / "crdlib" / "cloudcoil" / "models" / "prometheus_operator" / "v1.py").is_file()
        )

    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "k8s-tools.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if done.returncode != 0 or not present():
        pytest.fail(f"scripts/k8s-tools.sh could not install the deploy tooling:\n{done.stdout}\n{done.stderr}")
    return TOOLS


@pytest.fixture(scope="session")
def rendered(tools: Path) -> dict[str, str]:
    """Values-file name -> `helm template` output (with the test pod)."""
    return {name: helm(*template_args(values)).stdout for name, values in VALUES.items()}


@pytest.fixture(scope="session")
def objects(rendered: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    return {name: load_all(text) for name, text in rendered.items()}
