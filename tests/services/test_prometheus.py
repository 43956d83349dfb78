"""The chart's Grafana dashboard against a real Prometheus scraping the three services.

Debian's `prometheus` (installed by scripts/setup.sh) scrapes the
coordinator's, draft's and target's metrics ports every second while a short,
bounded load runs (fixed, pipelined, sampled, automatic and target-only
requests, and refused ones). Then every PromQL expression of
k8s/helm/specd/dashboards/specd.json is evaluated through Prometheus's HTTP
API, with Grafana's $__rate_interval as a window covering the run: each must
return series with finite values. The test skips, saying why, only when the
prometheus binary is not installed.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.client import build_request
from specd.v1 import coordinator_pb2_grpc
from tests.cluster import Cluster, metrics_address, scrape, total

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "helm" / "specd" / "dashboards" / "specd.json"
SCRAPE_INTERVAL = "1s"
WINDOW = "5m"  # stands for Grafana's $__rate_interval: the whole run
PROMPT = [5, 17, 42, 9, 33, 8]
# One of each kind of request; run twice, so every series exists at a scrape before it grows again.
LOAD: list[dict[str, Any]] = [
    dict(max_new_tokens=24, temperature=0, speculation="fixed", draft_length=4),
    dict(max_new_tokens=24, temperature=0, speculation="fixed", draft_length=4, pipeline=True),
    dict(max_new_tokens=20, temperature=0.9, top_k=50, speculation="fixed", draft_length=3),
    dict(max_new_tokens=16, temperature=0.7, speculation="auto"),
    dict(max_new_tokens=64, temperature=0, speculation="off"),  # long enough to catch held KV caches
]
REFUSED = dict(max_new_tokens=8, temperature=-1.0)  # INVALID_ARGUMENT: the errors panel needs one


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / legend, PromQL) of every target of the dashboard, Grafana variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", WINDOW)
            assert "$" not in expr, expr
            out.append((f"{panel['title']} / {target.get('legendFormat', target['refId'])}", expr))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


class Prometheus:
    """A prometheus server on 127.0.0.1 scraping the given jobs; stopped by its pid."""

    def __init__(self, binary: str, folder: Path, jobs: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        scrape_configs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{address}']\n"
            for job, address in jobs.items()
        )
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL}\n"
            f"  scrape_timeout: {SCRAPE_INTERVAL}\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL}\n"
            "scrape_configs:\n" + scrape_configs
        )
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.log_path = folder / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        return json.loads(body) if path.startswith("/api/") else body

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = self.get("/api/v1/query", query=expr)
        assert reply["status"] == "success", (expr, reply)
        return reply["data"]["result"]

    def ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited:\n" + self.log_path.read_text()[-3000:]
        return "Ready" in self.get("/-/ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip(
            "no prometheus binary: Debian's `prometheus` package is not installed "
            "(scripts/setup.sh installs it with apt-get when run as root)"
        )
    return path


@pytest.fixture(scope="module")
def scraped(
    prometheus_binary: str,
    tiny_pair: tuple[Path, Path],
    tiny_cluster: Cluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, Prometheus]]:
    """The services (the target as its own draft, so drafts are accepted) and a Prometheus scraping them.

    The target is the session's (it serves metrics); the draft and the coordinator are this module's.
    """
    flags = ["--metrics-port", "0"]
    target = tiny_pair[0]
    cluster = Cluster(
        target,
        target,
        cache_dir=tmp_path_factory.mktemp("cache"),
        coordinator_args=flags,
        draft_args=flags,
        borrow_target=tiny_cluster,
    )
    with cluster:
        assert cluster.coordinator is not None and cluster.draft is not None
        jobs = {f"specd-{s.name}": metrics_address(s) for s in (cluster.coordinator, cluster.draft, cluster.target)}
        prometheus = Prometheus(prometheus_binary, tmp_path_factory.mktemp("prometheus"), jobs)
        try:
            wait(prometheus.ready, 60, "prometheus to be ready")
            wait(
                lambda: len(prometheus.query("up == 1")) == len(jobs),
                60,
                "prometheus to scrape all three services",
            )
            yield cluster, prometheus
        finally:
            prometheus.stop()


def run_load(cluster: Cluster) -> tuple[int, int]:
    """One pass of LOAD plus a refused request; (requests served, requests refused)."""
    served = refused = 0
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for i, kwargs in enumerate(LOAD):
            response = stub.Generate(build_request(PROMPT, seed=100 + i, ignore_eos=True, **kwargs), timeout=120)
            assert response.stats.completion_tokens == kwargs["max_new_tokens"]
            served += 1
        try:
            stub.Generate(build_request(PROMPT, seed=1, **REFUSED), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            refused += 1
    return served, refused


def test_every_dashboard_query_returns_data(scraped: tuple[Cluster, Prometheus]) -> None:
    cluster, prometheus = scraped
    assert cluster.coordinator is not None and cluster.target is not None
    coordinator, target = metrics_address(cluster.coordinator), metrics_address(cluster.target)

    # While the load runs, watch the target's endpoint for KV caches held (the gauge reads them at scrape time).
    held: list[tuple[float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not held:
            samples = scrape(target)
            if total(samples, "specd:kv_cache_bytes") > 0:
                held.append((total(samples, "specd:sessions_active"), total(samples, "specd:kv_cache_bytes")))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        served, refused = run_load(cluster)
        # Let Prometheus see the first pass before the second, so every series grows between scrapes.
        rounds = total(scrape(coordinator), "specd:spec_decode_num_rounds_total")
        wait(
            lambda: prometheus.query(f"specd:spec_decode_num_rounds_total >= {rounds}"),
            30,
            "prometheus to scrape the first pass",
        )
        time.sleep(1.5)
        more = run_load(cluster)
        served, refused = served + more[0], refused + more[1]
    finally:
        stop.set()
        watcher.join(10)
    assert held and held[0][0] >= 1 and held[0][1] > 0, "no KV-cache bytes seen while sessions were held"

    # Prometheus holds the final counts.
    final = scrape(coordinator)
    rounds = total(final, "specd:spec_decode_num_rounds_total")
    assert total(final, "specd:request_success_total") == served and served == 2 * len(LOAD)
    assert total(final, "specd:request_failure_total", code="INVALID_ARGUMENT") == refused == 2
    assert total(final, "specd:spec_decode_num_pipeline_hits_total") > 0
    wait(
        lambda: prometheus.query(f"specd:spec_decode_num_rounds_total == {rounds}"),
        30,
        "prometheus to scrape the final counts",
    )
    time.sleep(1.5)  # one more scrape of every job

    queries = dashboard_queries()
    assert len(queries) >= 20
    empty, not_finite = [], []
    for name, expr in queries:
        result = prometheus.query(expr)
        if not result:
            empty.append(f"{name}: {expr}")
        elif not all(math.isfinite(float(series["value"][1])) for series in result):
            not_finite.append(f"{name}: {[s['value'][1] for s in result]}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not not_finite, "queries with NaN or infinite values:\n" + "\n".join(not_finite)

    # A few values the run determines exactly.
    by_code = prometheus.query(f"sum by (code) (increase(specd:request_failure_total[{WINDOW}]))")
    assert {s["metric"]["code"] for s in by_code} == {"INVALID_ARGUMENT"}
    positions = prometheus.query("sum by (position) (specd:spec_decode_num_accepted_tokens_per_pos_total)")
    assert {s["metric"]["position"] for s in positions} >= {"0", "1", "2", "3"}
    jobs = prometheus.query("sum by (job) (specd:sessions_active)")
    assert {s["metric"]["job"] for s in jobs} == {"specd-draft", "specd-target"}
    genai = prometheus.query(
        "sum by (gen_ai_operation_name, error_type) (gen_ai_server_request_duration_seconds_count)"
    )
    assert {(s["metric"]["gen_ai_operation_name"], s["metric"].get("error_type", "")) for s in genai} == {
        ("text_completion", ""),
        ("text_completion", "INVALID_ARGUMENT"),
    }
