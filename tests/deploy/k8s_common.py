"""What the deployment checks share: the chart and tool paths, the values files, helm and validation helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "helm" / "specd"
MANIFESTS = ROOT / "k8s" / "manifests"
TOOLS = ROOT / ".tools"
HELM = TOOLS / "bin" / "helm"
KUBECTL = TOOLS / "bin" / "kubectl"
HADOLINT = TOOLS / "bin" / "hadolint"
KUBE_VERSION = "1.31.0"
RELEASE = "specd"
# name -> values file in the chart (None: the chart's defaults)
VALUES: dict[str, str | None] = {
    "default": None,
    "gpu-tp4": "ci/gpu-tp4-values.yaml",
    "ray-multinode": "ci/ray-multinode-values.yaml",
    "tls-cert-manager": "ci/tls-cert-manager-values.yaml",
    "cpu-demo": "ci/cpu-demo-values.yaml",
    "minimal": "ci/minimal-values.yaml",
    "monitoring": "ci/monitoring-values.yaml",
    "scale-out": "ci/scale-out-values.yaml",
}
# Custom resources: no schema in kubernetes-validate; checked by hand below,
# their pod templates strictly as core/v1 PodTemplates.
CRD_KINDS = {
    ("ray.io/v1", "RayCluster"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),  # validated against the operator's CRD schema
}
MONITORING_API = "monitoring.coreos.com/v1"
DASHBOARD = CHART / "dashboards" / "specd.json"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(HELM), *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def template_args(values: str | None, chart: Path = CHART) -> list[str]:
    args = ["template", RELEASE, str(chart), "--kube-version", KUBE_VERSION]
    return args + (["-f", str(chart / values)] if values else [])


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(object name, pod template metadata, pod spec) of every workload, RayCluster groups included."""
    for o in objs:
        if o["kind"] == "Deployment":
            yield o["metadata"]["name"], o["spec"]["template"]["metadata"], o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            yield o["metadata"]["name"], o["metadata"], o["spec"]
        elif o["kind"] == "RayCluster":
            head = o["spec"]["headGroupSpec"]["template"]
            yield o["metadata"]["name"] + "/head", head["metadata"], head["spec"]
            for group in o["spec"]["workerGroupSpecs"]:
                t = group["template"]
                yield f"{o['metadata']['name']}/{group['groupName']}", t["metadata"], t["spec"]


def kubernetes_validate(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", KUBE_VERSION, *map(str, paths)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS / "pylib")},
    )
