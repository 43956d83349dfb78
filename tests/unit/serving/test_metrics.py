"""Metrics objects in-process: names, what one round and one request add, per-service registries.

The services' endpoints are scraped end to end in test_tracing.py (one cluster serves both).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.core.rounds.record import RoundRecord, TargetOnly, TokenKind
from specd.serving import genai
from specd.serving.metrics import CoordinatorMetrics, DraftMetrics, TargetMetrics
from specd.serving.metrics_http import serve_metrics


def samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_rounds_and_requests_use_vllm_names_and_add_up() -> None:
    m = CoordinatorMetrics()
    running = [2]
    m.watch_requests(lambda: running[0])
    # accepted 2 of 4 (recovered), 4 of 4 (bonus), a target-only round (draft down), 0 of 3.
    rounds = [(4, 2, False, 3), (4, 4, False, 5), (0, 0, True, 1), (3, 0, False, 1)]
    for i, (drafted, accepted, target_only, tokens) in enumerate(rounds):
        m.observe_round(
            RoundRecord(
                index=i,
                committed_length=10 + i,
                draft_length=4,
                draft_token_ids=tuple(range(drafted)),
                accepted=accepted,
                token_id=7,
                token_kind=TokenKind.BONUS if accepted == drafted else TokenKind.RECOVERED,
                committed=tuple(range(tokens)),
                wall_ms=8.0,
                draft_ms=2.0,
                verify_ms=5.0,
                target_only=TargetOnly.DRAFT_FAILED if target_only else None,
            )
        )
    stats = SimpleNamespace(
        prompt_tokens=7,
        completion_tokens=10,
        time_to_first_token_ms=30.0,
        tokens_per_s=100.0,
        rounds=SimpleNamespace(pipeline_hits=2),
    )
    m.observe_request(stats, "length", 0.1, model="m")
    m.observe_failure("Unavailable", "UNAVAILABLE", 0.5, model="m")
    got = samples(m.registry)
    assert got[("specd:spec_decode_num_drafts_total", ())] == 3
    assert got[("specd:spec_decode_num_draft_tokens_total", ())] == 11
    assert got[("specd:spec_decode_num_accepted_tokens_total", ())] == 6
    per_pos = [got[("specd:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(4)]
    assert per_pos == [2, 2, 1, 1]
    # acceptance length = 1 + accepted / drafts, from the histogram's sum / count
    assert (
        got[("specd:spec_decode_acceptance_length_sum", ())] / got[("specd:spec_decode_acceptance_length_count", ())]
        == 1 + 6 / 3
    )
    assert got[("specd:spec_decode_num_rounds_total", ())] == 4
    assert got[("specd:spec_decode_num_target_only_rounds_total", ())] == 1
    for part in ("draft", "verify", "overhead"):
        assert got[("specd:round_seconds_count", (("part", part),))] == 4
    assert got[("specd:round_seconds_sum", (("part", "verify"),))] == 4 * 0.005
    assert got[("specd:inter_token_latency_seconds_count", ())] == 3  # rounds after the first
    assert got[("specd:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("specd:request_failure_total", (("code", "UNAVAILABLE"), ("error", "Unavailable")))] == 1
    # generation tokens count as rounds commit (3 + 5 + 1 + 1), prompt tokens when the request finishes
    assert got[("specd:generation_tokens_total", ())] == 10 and got[("specd:prompt_tokens_total", ())] == 7
    assert got[("specd:spec_decode_num_pipeline_hits_total", ())] == 2
    assert got[("specd:time_to_first_token_seconds_sum", ())] == 0.03
    assert got[("specd:e2e_request_latency_seconds_count", ())] == 1
    assert got[("specd:request_tokens_per_second_count", ())] == 1
    assert got[("specd:num_requests_running", ())] == 2
    running[0] = 0
    assert samples(m.registry)[("specd:num_requests_running", ())] == 0  # read at scrape time


def test_draft_and_target_metrics() -> None:
    d, t = DraftMetrics(), TargetMetrics()
    d.watch_sessions(lambda: 3)
    d.observe_message("propose", "ok")
    d.observe_propose(4, 1.5)
    d.observe_message("propose", "session_not_found")
    t.observe_verify(4, 1, "recovered", 6.0)
    t.observe_verify(2, 2, "bonus", 4.0)
    t.observe_message("verify", "ok")
    got_d, got_t = samples(d.registry), samples(t.registry)
    assert got_d[("specd:draft_requests_total", (("op", "propose"), ("result", "ok")))] == 1
    assert got_d[("specd:draft_requests_total", (("op", "propose"), ("result", "session_not_found")))] == 1
    assert got_d[("specd:draft_proposed_tokens_total", ())] == 4
    assert got_d[("specd:sessions_active", ())] == 3
    assert got_t[("specd:target_verified_draft_tokens_total", ())] == 6
    assert got_t[("specd:target_accepted_tokens_total", ())] == 3
    assert got_t[("specd:target_verdicts_total", (("kind", "bonus"),))] == 1
    assert got_t[("specd:target_verify_seconds_count", ())] == 2


def test_each_service_has_its_own_registry_and_endpoint() -> None:
    # Two of each in one process: no clash, because nothing registers globally.
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    assert isinstance(first, CoordinatorMetrics) and first.registry is not second.registry
    first.observe_failure("cancelled", "CANCELLED")
    assert not any(name.startswith("specd:") for name in REGISTRY._names_to_collectors)
    server, port = serve_metrics(first.registry, "127.0.0.1", 0)
    try:
        assert port > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'specd:request_failure_total{code="CANCELLED",error="cancelled"} 1.0' in text
        # Prometheus 2.x asks for OpenMetrics without an escaping scheme; the names must keep their colons
        # (prometheus_client would answer with escaping=underscores: specd_request_failure_total).
        prometheus2 = (
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
            "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        )
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": prometheus2})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
        assert "specd:request_failure_total" in names and not any(n.startswith("specd_") for n in names)
    finally:
        server.shutdown()


def test_clients_that_send_nothing_hold_no_thread_and_are_closed_when_idle() -> None:
    """50 connections that never send a request: a scrape still answers at once, the threads stay
    the server's few (not one per connection), and each idle connection is closed after the timeout."""
    m = CoordinatorMetrics()
    threads_before = threading.active_count()
    server, port = serve_metrics(m.registry, "127.0.0.1", 0, idle_timeout_s=1)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    try:
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.status == 200 and b"specd:" in response.read()
        assert time.monotonic() - started < 1.0
        assert threading.active_count() - threads_before <= 4  # workers and the I/O thread, not 50 more
        closed_by = time.monotonic() + 4.0  # timeout 1 s + the once-a-second sweep + room
        for sock in silent:
            sock.settimeout(max(0.01, closed_by - time.monotonic()))
            assert sock.recv(1) == b""  # the server closed it
        # And it still serves after closing them.
        assert b"specd:" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        for sock in silent:
            sock.close()
        server.shutdown()
    assert threading.active_count() <= threads_before  # shutdown stopped every thread it started


def test_genai_server_metrics_follow_the_conventions() -> None:
    """gen_ai.server.* under their Prometheus names, with the conventions' buckets and attributes as labels."""
    m = CoordinatorMetrics()
    stats = SimpleNamespace(
        prompt_tokens=4,
        completion_tokens=11,
        time_to_first_token_ms=20.0,
        tokens_per_s=50.0,
        rounds=SimpleNamespace(pipeline_hits=0),
    )
    m.observe_request(stats, "stop_token", 0.22, model="tiny")
    one = SimpleNamespace(**{**vars(stats), "completion_tokens": 1})
    m.observe_request(one, "length", 0.05, model="tiny")  # one output token: no time per output token
    m.observe_failure("InvalidArgument", "INVALID_ARGUMENT", 0.003, model="tiny")
    got = samples(m.registry)
    labels = (("gen_ai_operation_name", "text_completion"), ("gen_ai_provider_name", "specd"))
    model = (("gen_ai_request_model", "tiny"),)
    ok = (("error_type", ""), *labels, *model)
    failed = (("error_type", "INVALID_ARGUMENT"), *labels, *model)
    assert got[("gen_ai_server_request_duration_seconds_count", ok)] == 2
    assert got[("gen_ai_server_request_duration_seconds_sum", ok)] == pytest.approx(0.27)
    assert got[("gen_ai_server_request_duration_seconds_count", failed)] == 1
    assert got[("gen_ai_server_time_to_first_token_seconds_count", (*labels, *model))] == 2
    # (0.22 - 0.02) / (11 - 1) = 0.02 s per output token after the first
    assert got[("gen_ai_server_time_per_output_token_seconds_count", (*labels, *model))] == 1
    assert got[("gen_ai_server_time_per_output_token_seconds_sum", (*labels, *model))] == pytest.approx(0.02)
    # The conventions' explicit bucket boundaries (plus +Inf).
    for name, buckets in (
        ("gen_ai_server_request_duration_seconds", genai.REQUEST_DURATION_BUCKETS),
        ("gen_ai_server_time_to_first_token_seconds", genai.TIME_TO_FIRST_TOKEN_BUCKETS),
        ("gen_ai_server_time_per_output_token_seconds", genai.TIME_PER_OUTPUT_TOKEN_BUCKETS),
    ):
        les = sorted({float(dict(ls)["le"]) for (n, ls) in got if n == name + "_bucket"})
        assert les == [*buckets, float("inf")], name
    assert genai.REQUEST_DURATION_BUCKETS[:3] == (0.01, 0.02, 0.04) and genai.REQUEST_DURATION_BUCKETS[-1] == 81.92
    assert genai.TIME_TO_FIRST_TOKEN_BUCKETS[0] == 0.001 and genai.TIME_TO_FIRST_TOKEN_BUCKETS[-1] == 10.0
    assert genai.TIME_PER_OUTPUT_TOKEN_BUCKETS[0] == 0.01 and genai.TIME_PER_OUTPUT_TOKEN_BUCKETS[-1] == 2.5


def test_kv_bytes_are_read_at_scrape_time_even_while_sessions_change() -> None:
    d = DraftMetrics()
    sessions = {"a": 100, "b": 28}
    calls = [0]

    def kv_bytes() -> int:
        calls[0] += 1
        if calls[0] == 2:  # the model thread adds a session mid-sum: the next try succeeds
            raise RuntimeError("dictionary changed size during iteration")
        return sum(sessions.values())

    d.watch_sessions(lambda: len(sessions), kv_bytes)
    assert samples(d.registry)[("specd:kv_cache_bytes", ())] == 128
    sessions["c"] = 72
    assert samples(d.registry)[("specd:kv_cache_bytes", ())] == 200
    assert samples(d.registry)[("specd:sessions_active", ())] == 3
    t = TargetMetrics()
    t.watch_sessions(lambda: 0)  # no KV reader (a drafter without a model): the gauge stays at 0
    assert samples(t.registry)[("specd:kv_cache_bytes", ())] == 0


def test_shutdown_survives_the_io_thread_running_its_close_before_the_wake_up_byte() -> None:
    """waitress queues shutdown's close, then writes the byte that wakes its I/O thread; a worker's
    earlier byte can wake that thread in between, so the close runs first and the write finds the
    trigger closed (EBADF). The test makes that ordering certain instead of rare."""
    server, _ = serve_metrics(CollectorRegistry(), "127.0.0.1", 0)
    trigger = server._server.trigger
    pull = trigger._physical_pull

    def late_pull() -> None:
        pull()  # a worker's wake-up: the I/O thread runs the queued close and its loop ends
        server._thread.join(5)
        pull()  # shutdown's own byte, to a closed pipe

    trigger._physical_pull = late_pull
    server.shutdown()
    assert not server._thread.is_alive()
