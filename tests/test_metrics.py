"""Metrics objects in-process: names, what one round and one request add, per-service registries.

The services' endpoints are scraped end to end in test_tracing.py (one cluster serves both).
"""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.core.record import RoundRecord, TargetOnly, TokenKind
from specd.serving.metrics import CoordinatorMetrics, DraftMetrics, TargetMetrics, metrics_for, serve_metrics


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
    stats = SimpleNamespace(prompt_tokens=7, completion_tokens=10, time_to_first_token_ms=30.0, tokens_per_s=100.0)
    m.observe_request(stats, "length", 0.1)
    m.observe_failure("Unavailable")
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
    assert got[("specd:request_failure_total", (("error", "Unavailable"),))] == 1
    assert got[("specd:generation_tokens_total", ())] == 10 and got[("specd:prompt_tokens_total", ())] == 7
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
    first, second = metrics_for("coordinator"), metrics_for("coordinator")
    assert isinstance(first, CoordinatorMetrics) and first.registry is not second.registry
    first.observe_failure("cancelled")
    assert not any(name.startswith("specd:") for name in REGISTRY._names_to_collectors)
    server, port = serve_metrics(first.registry, "127.0.0.1", 0)
    try:
        assert port > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'specd:request_failure_total{error="cancelled"} 1.0' in text
    finally:
        server.shutdown()
