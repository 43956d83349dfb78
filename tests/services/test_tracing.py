"""Tracing end to end: the three services as processes exporting to a real OTLP/gRPC receiver started here.

They also scrape the services' Prometheus endpoints (one cluster serves both, to
keep the suite quick). Set-up and context in-process: tests/unit/serving/test_tracing_context.py.
"""

from __future__ import annotations

import itertools
import json
import secrets
import signal
import socket
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from coordinator.client import build_request
from specd.serving import genai, trace_names
from specd.tools.otlp_receiver import OtlpReceiver, ReceivedSpan
from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.cluster import READY_TIMEOUT_S, Cluster, QuietService, metrics_address, scrape, total

# ---- end to end: three services, a real OTLP receiver -----------------------------------


def cluster_with(target: Path, cache: Path, *, endpoint: str | None) -> Cluster:
    """target, a draft of the same model (so tokens get accepted: bonus and recovered both occur), coordinator."""
    flags = ["--metrics-port", "0"] + (["--otlp-endpoint", endpoint] if endpoint else [])
    coordinator = [*flags, "--http-port", "0"]  # the OpenAI HTTP API's requests are traced alike
    c = Cluster(target, target, cache_dir=cache, coordinator_args=coordinator, target_args=flags, draft_args=flags)
    for name in [k for k in c.env if k.startswith("OTEL_")]:
        del c.env[name]
    c.env["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # export within 50 ms, so tests need not wait
    return c


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver):
    with cluster_with(tiny_pair[0], tmp_path_factory.mktemp("cache"), endpoint=receiver.endpoint) as c:
        yield c


@dataclass
class Call:
    response: coordinator_pb2.GenerateResponse
    trace_id: str | None  # the client's trace, when it sent one
    seed: int
    speculative: bool


def generate(cluster: Cluster | str, *, stream: bool = False, traceparent: bool = True, seed: int, **kwargs) -> Call:
    request = build_request([5, 17, 42, 9, 33, 8], seed=seed, ignore_eos=True, **kwargs)
    trace_id = secrets.token_hex(16) if traceparent else None
    metadata = [("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")] if trace_id else None
    with grpc.insecure_channel(cluster if isinstance(cluster, str) else cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        if stream:
            response = coordinator_pb2.GenerateResponse()
            for msg in stub.GenerateStream(request, metadata=metadata, timeout=60):
                response.token_ids.extend(msg.token_ids)
                if msg.HasField("stats"):
                    response.stats.CopyFrom(msg.stats)
                    response.finish_reason = msg.finish_reason
        else:
            response = stub.Generate(request, metadata=metadata, timeout=60)
    return Call(response, trace_id, seed, kwargs.get("speculation") != "off")


def is_generate(span: ReceivedSpan) -> bool:
    """The Generate span: named "text_completion MODEL" by the GenAI conventions."""
    return (
        span.service == trace_names.SERVICE_COORDINATOR
        and span.attributes.get(trace_names.ATTR_GENAI_OPERATION) == genai.OPERATION
    )


def trace_of(spans: list[ReceivedSpan], call: Call) -> list[ReceivedSpan]:
    if call.trace_id is not None:
        return [s for s in spans if s.trace_id == call.trace_id]
    roots = [s for s in spans if is_generate(s) and s.attributes.get(trace_names.ATTR_SEED) == call.seed]
    return [s for s in spans if roots and s.trace_id == roots[0].trace_id]


MESSAGE_SPANS = {
    trace_names.SPAN_DRAFT_OPEN,
    trace_names.SPAN_DRAFT_PROPOSE,
    trace_names.SPAN_DRAFT_CLOSE,
    trace_names.SPAN_TARGET_OPEN,
    trace_names.SPAN_TARGET_VERIFY,
    trace_names.SPAN_TARGET_CLOSE,
}


def complete(trace: list[ReceivedSpan], call: Call) -> bool:
    rounds = [s.attributes for s in trace if s.name == trace_names.SPAN_ROUND]
    verifies = [s for s in trace if s.name == trace_names.SPAN_TARGET_VERIFY]
    # a draft call per round that verified drafts, plus each pre-draft no round used (the opening's
    # guess of the first token, drafted beside the prefill, misses now and then at T > 0)
    unused = sum(r[trace_names.ATTR_ROUND_PIPELINE_LAUNCHED] - r[trace_names.ATTR_ROUND_PIPELINE_HIT] for r in rounds)
    return (
        sum(is_generate(s) for s in trace) == 1
        and len(rounds) == call.response.stats.rounds
        and len(verifies) == len(rounds)
        and sum(s.name == trace_names.SPAN_DRAFT_PROPOSE for s in trace) == call.response.stats.drafts + unused
    )


CALLS = [
    dict(max_new_tokens=24, temperature=0, speculation="fixed", draft_length=4),
    dict(max_new_tokens=20, temperature=0.9, speculation="fixed", draft_length=3, stream=True),
    dict(max_new_tokens=10, temperature=0, speculation="off"),
    dict(max_new_tokens=16, temperature=0.7, top_k=20, speculation="fixed", draft_length=5, traceparent=False),
]


def test_an_http_request_is_the_same_trace_under_the_callers_span(traced: Cluster, receiver: OtlpReceiver) -> None:
    """POST /v1/completions with a traceparent header: one Generate span, a child of the caller's,
    naming the route, with a round span per round, as a gRPC Generate gets."""
    assert traced.coordinator is not None and traced.coordinator.http_address
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {"prompt": [5, 17, 42, 9, 33, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "draft_length": 3}
    request = urllib.request.Request(
        f"http://{traced.coordinator.http_address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent}-01"},
    )
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    rounds = reply["specd"]["rounds"]

    def done(spans: list[ReceivedSpan]) -> bool:
        trace = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name == trace_names.SPAN_ROUND for s in trace) == rounds and any(is_generate(s) for s in trace)

    trace = [s for s in receiver.wait_for(done) if s.trace_id == trace_id]
    (gen,) = [s for s in trace if is_generate(s)]
    assert gen.parent_span_id == parent and gen.status_code != 2
    assert gen.attributes["http.route"] == "/v1/completions" and gen.attributes["http.request.method"] == "POST"
    assert all(s.parent_span_id == gen.span_id for s in trace if s.name == trace_names.SPAN_ROUND)
    assert trace_names.SERVICE_TARGET in {s.service for s in trace}


def test_each_generate_is_one_trace_with_a_span_per_round(traced: Cluster, receiver: OtlpReceiver) -> None:
    calls = [generate(traced, seed=1000 + i + secrets.randbelow(10**6) * 10, **kw) for i, kw in enumerate(CALLS)]
    spans = receiver.wait_for(lambda spans: all(complete(trace_of(spans, c), c) for c in calls))
    for call in calls:
        stats = call.response.stats
        trace = trace_of(spans, call)
        assert complete(trace, call), (call, sorted(s.name for s in trace), traced.logs())
        by_id = {s.span_id: s for s in trace}
        (gen,) = [s for s in trace if is_generate(s)]
        rounds = sorted(
            (s for s in trace if s.name == trace_names.SPAN_ROUND),
            key=lambda s: s.attributes[trace_names.ATTR_ROUND_INDEX],
        )
        # One trace across the three services, rooted at the Generate span (or the client's span).
        expected = {trace_names.SERVICE_COORDINATOR, trace_names.SERVICE_TARGET} | (
            {trace_names.SERVICE_DRAFT} if call.speculative else set()
        )
        assert {s.service for s in trace} == expected
        assert gen.service == trace_names.SERVICE_COORDINATOR and gen.status_code != 2
        assert (gen.parent_span_id != "") == (call.trace_id is not None)
        assert all(s.resource["service.version"] for s in trace)
        # One round span per round, children of the Generate span, in order.
        assert len(rounds) == stats.rounds
        assert [r.attributes[trace_names.ATTR_ROUND_INDEX] for r in rounds] == list(range(stats.rounds))
        assert all(r.parent_span_id == gen.span_id and r.service == trace_names.SERVICE_COORDINATOR for r in rounds)
        lengths = [r.attributes[trace_names.ATTR_COMMITTED_LENGTH] for r in rounds]
        assert lengths == sorted(set(lengths))
        # Every draft and target message span hangs under the round its message belonged to;
        # their phase spans (sync, forward, sampling, rollback) under the message span.
        children: dict[str, list[ReceivedSpan]] = defaultdict(list)
        phases: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for s in trace:
            if s.service in (trace_names.SERVICE_DRAFT, trace_names.SERVICE_TARGET) and s.name not in MESSAGE_SPANS:
                parent = by_id.get(s.parent_span_id)
                assert parent is not None and parent.name in MESSAGE_SPANS and parent.service == s.service, s
                assert parent.start_ns <= s.start_ns <= s.end_ns <= parent.end_ns, s
                phases[parent.span_id].append(s)
        next_round = {r.span_id: n for r, n in itertools.pairwise(rounds)}
        for s in trace:
            if s.service in (trace_names.SERVICE_DRAFT, trace_names.SERVICE_TARGET) and s.name in MESSAGE_SPANS:
                parent = by_id.get(s.parent_span_id)
                assert parent is not None and parent.name == trace_names.SPAN_ROUND, s
                n = next_round.get(parent.span_id)
                if (
                    n is not None
                    and n.attributes[trace_names.ATTR_ROUND_STAGED]
                    and s.attributes[trace_names.ATTR_COMMITTED_LENGTH]
                    == n.attributes[trace_names.ATTR_COMMITTED_LENGTH]
                ):
                    # the next round's verify, staged at the target while this round was verified (the
                    # opening's pre-draft landed during the prefill): sent under this round, it is the next's
                    parent = n
                assert (
                    s.attributes[trace_names.ATTR_COMMITTED_LENGTH]
                    == parent.attributes[trace_names.ATTR_COMMITTED_LENGTH]
                ), s
                assert s.attributes[trace_names.ATTR_SESSION_ID] == gen.attributes[trace_names.ATTR_SESSION_ID]
                children[parent.span_id].append(s)
        for r in rounds:
            names = sorted(c.name for c in children[r.span_id])
            verify = [c for c in children[r.span_id] if c.name == trace_names.SPAN_TARGET_VERIFY]
            assert len(verify) == 1, names
            assert verify[0].attributes[trace_names.ATTR_ACCEPTED] == r.attributes[trace_names.ATTR_ROUND_ACCEPTED]
            assert verify[0].attributes[trace_names.ATTR_TOKEN_KIND] == r.attributes[trace_names.ATTR_ROUND_TOKEN_KIND]
            assert [p.name for p in sorted(phases[verify[0].span_id], key=lambda p: p.start_ns)] == [
                trace_names.SPAN_TARGET_PHASE_PREFIX + name for name in ("sync", "forward", "sampling", "rollback")
            ]
            proposes = [c for c in children[r.span_id] if c.name == trace_names.SPAN_DRAFT_PROPOSE]
            if r.attributes[trace_names.ATTR_ROUND_TARGET_ONLY_REASON] == "opening":
                # the coordinator opens beside a model draft (--opening auto): the prompt is verified
                # alone, and the draft's first call (a guess of the first token, K more) is beside it
                assert r.attributes[trace_names.ATTR_ROUND_DRAFT_TOKENS] == 0 and len(proposes) == 1, names
                continue
            fresh = (
                r.attributes[trace_names.ATTR_ROUND_DRAFT_TOKENS]
                and not r.attributes[trace_names.ATTR_ROUND_PIPELINE_HIT]
            )  # a round after the opening verifies its drafts when the guess was right
            assert len(proposes) == (1 if fresh else 0), names
            for p in proposes:
                assert p.attributes[trace_names.ATTR_DRAFT_TOKENS] == r.attributes[trace_names.ATTR_ROUND_DRAFT_TOKENS]
                assert {c.name for c in phases[p.span_id]} == {
                    trace_names.SPAN_DRAFT_PHASE_PREFIX + name for name in ("sync", "forward", "sampling")
                }
        assert sum(c.name == trace_names.SPAN_TARGET_OPEN for cs in children.values() for c in cs) == 1
        assert rounds[0].attributes[trace_names.ATTR_ROUND_PIPELINE_HIT] is False
        if call.speculative and stats.rounds > 2:  # a model draft: round 0 verified the prompt alone
            assert rounds[0].attributes[trace_names.ATTR_ROUND_TARGET_ONLY_REASON] == "opening"


def test_round_spans_add_up_to_the_response_stats(traced: Cluster, receiver: OtlpReceiver) -> None:
    calls = [generate(traced, seed=2000 + i + secrets.randbelow(10**6) * 10, **kw) for i, kw in enumerate(CALLS)]
    spans = receiver.wait_for(lambda spans: all(complete(trace_of(spans, c), c) for c in calls))
    for call in calls:
        stats = call.response.stats
        trace = trace_of(spans, call)
        rounds = [s.attributes for s in trace if s.name == trace_names.SPAN_ROUND]
        assert len(rounds) == stats.rounds
        assert sum(r[trace_names.ATTR_ROUND_ACCEPTED] for r in rounds) == stats.accepted_tokens
        assert sum(r[trace_names.ATTR_ROUND_DRAFT_TOKENS] for r in rounds) == stats.draft_tokens
        assert (
            sum(r[trace_names.ATTR_ROUND_TOKENS] for r in rounds)
            == stats.completion_tokens
            == len(call.response.token_ids)
        )
        assert sum(r[trace_names.ATTR_ROUND_DRAFT_TOKENS] > 0 for r in rounds) == stats.drafts
        assert sum(r[trace_names.ATTR_ROUND_TARGET_ONLY] for r in rounds) == stats.target_only_rounds
        for r in rounds:
            assert (
                r[trace_names.ATTR_ROUND_ACCEPTED]
                <= r[trace_names.ATTR_ROUND_DRAFT_TOKENS]
                <= r[trace_names.ATTR_ROUND_DRAFT_LENGTH]
            )
            assert r[trace_names.ATTR_ROUND_TOKEN_KIND] in (
                trace_names.TOKEN_KIND_BONUS,
                trace_names.TOKEN_KIND_RECOVERED,
            )
            # (a staged round's verify ran at the target during the round before: the opening's pre-draft
            # landed during the prefill, and the next round's verify went out before that round began)
            assert r[trace_names.ATTR_ROUND_STAGED] or (
                r[trace_names.ATTR_ROUND_WALL_MS]
                >= r[trace_names.ATTR_ROUND_DRAFT_MS] + r[trace_names.ATTR_ROUND_VERIFY_MS] - 1e-6
            )
        (gen,) = [s.attributes for s in trace if is_generate(s)]
        assert gen[trace_names.ATTR_ROUNDS] == stats.rounds and gen[trace_names.ATTR_DRAFTS] == stats.drafts
        assert (
            gen[trace_names.ATTR_ACCEPTED_TOKENS] == stats.accepted_tokens
            and gen[trace_names.ATTR_DRAFT_TOKENS] == stats.draft_tokens
        )
        assert (
            gen[trace_names.ATTR_COMPLETION_TOKENS] == stats.completion_tokens
            and gen[trace_names.ATTR_FINISH_REASON] == "length"
        )
        assert gen[trace_names.ATTR_SEED] == call.seed and gen[trace_names.ATTR_PROMPT_TOKENS] == 6
        assert gen[trace_names.ATTR_ACCEPTANCE_LENGTH] == pytest.approx(stats.acceptance_length)
        assert gen[trace_names.ATTR_DRAFT_MS] == pytest.approx(sum(r[trace_names.ATTR_ROUND_DRAFT_MS] for r in rounds))


def test_generate_span_follows_the_genai_conventions(traced: Cluster, receiver: OtlpReceiver) -> None:
    """Span name "{operation} {model}", gen_ai.request/response/usage attributes; specd.* speculation kept."""
    with grpc.insecure_channel(traced.address) as channel:
        model = coordinator_pb2_grpc.CoordinatorStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest()).name
    assert model
    seed = 6000 + secrets.randbelow(10**6) * 10
    call = generate(
        traced,
        seed=seed,
        max_new_tokens=12,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        stop=["never-produced-1", "never-produced-2"],
        speculation="fixed",
        draft_length=3,
    )
    stats = call.response.stats
    spans = receiver.wait_for(lambda spans: complete(trace_of(spans, call), call))
    (gen,) = [s for s in trace_of(spans, call) if is_generate(s)]
    a = gen.attributes
    assert gen.name == f"text_completion {model}" and gen.kind == 2  # SpanKind SERVER in OTLP
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "specd"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == model
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.seed"] == seed
    assert a["gen_ai.request.temperature"] == pytest.approx(0.8) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.top_k"] == 40.0
    # Stop strings may be secrets or user text: only their count is recorded, in no span of the trace.
    assert "gen_ai.request.stop_sequences" not in a and a[trace_names.ATTR_STOP_STRINGS] == 2
    values = [str(v) for s in trace_of(spans, call) for v in s.attributes.values()]
    assert not [v for v in values if "never-produced" in v]
    assert a["gen_ai.response.id"] == a[trace_names.ATTR_SESSION_ID] and len(a["gen_ai.response.id"]) == 32
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a[trace_names.ATTR_FINISH_REASON] == "length"
    assert a["gen_ai.usage.input_tokens"] == 6
    assert a["gen_ai.usage.output_tokens"] == stats.completion_tokens == len(call.response.token_ids) == 12
    # specd's own: the speculation settings and results stay under specd.*
    assert a["specd.request.speculation"] == "fixed" and a["specd.request.draft_length"] == 3
    assert a["specd.rounds"] == stats.rounds and a["specd.drafts"] == stats.drafts > 0
    assert a["specd.accepted_tokens"] == stats.accepted_tokens and a["specd.draft_tokens"] == stats.draft_tokens
    assert a["specd.acceptance_length"] == pytest.approx(stats.acceptance_length)
    assert a["specd.pipeline_hits"] == stats.pipeline_hits
    # No second name for what the conventions name.
    assert not {"specd.request.temperature", "specd.request.seed", "specd.completion_tokens"} & set(a)
    # A refused request: the span still names the operation and model, and says why it failed.
    with pytest.raises(grpc.RpcError) as refused:
        generate(traced, seed=seed + 1, max_new_tokens=4, temperature=-1.0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(
        lambda spans: any(is_generate(s) and s.attributes.get(trace_names.ATTR_ERROR_TYPE) for s in spans), timeout=30
    )
    failed = [s for s in spans if is_generate(s) and s.attributes.get(trace_names.ATTR_ERROR_TYPE) == "InvalidArgument"]
    assert failed and all(f.name == f"text_completion {model}" and f.status_code == 2 for f in failed)


def test_metrics_endpoints_count_what_was_served(traced: Cluster) -> None:
    assert traced.coordinator is not None and traced.draft is not None
    addresses = {s.name: metrics_address(s) for s in (traced.coordinator, traced.draft, traced.target)}
    before = {name: scrape(a) for name, a in addresses.items()}
    calls = [generate(traced, **{**kw, "seed": 3000 + i, "traceparent": False}) for i, kw in enumerate(CALLS)]
    calls.append(generate(traced, seed=4000, max_new_tokens=24, temperature=0, speculation="fixed", draft_length=4))
    after = {name: scrape(a) for name, a in addresses.items()}

    def delta(service: str, name: str, **labels: str) -> float:
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    stats = [c.response.stats for c in calls]
    rounds, drafts = sum(s.rounds for s in stats), sum(s.drafts for s in stats)
    draft_tokens, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    tokens = sum(s.completion_tokens for s in stats)
    assert drafts > 0 and accepted > 0
    c = "coordinator"
    assert delta(c, "specd:spec_decode_num_drafts_total") == drafts
    assert delta(c, "specd:spec_decode_num_draft_tokens_total") == draft_tokens
    assert delta(c, "specd:spec_decode_num_accepted_tokens_total") == accepted
    assert delta(c, "specd:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    per_pos = [delta(c, "specd:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(5)]
    assert per_pos == sorted(per_pos, reverse=True)  # accepted at position i+1 means accepted at i
    assert delta(c, "specd:spec_decode_acceptance_length_count") == drafts
    assert delta(c, "specd:spec_decode_acceptance_length_sum") == drafts + accepted
    assert delta(c, "specd:spec_decode_num_rounds_total") == rounds
    assert delta(c, "specd:request_success_total") == len(calls)
    assert delta(c, "specd:request_success_total", finished_reason="length") == len(calls)
    assert delta(c, "specd:generation_tokens_total") == tokens
    assert delta(c, "specd:prompt_tokens_total") == 6 * len(calls)
    assert delta(c, "specd:time_to_first_token_seconds_count") == len(calls)
    assert delta(c, "specd:e2e_request_latency_seconds_count") == len(calls)
    assert delta(c, "specd:inter_token_latency_seconds_count") == rounds - len(calls)
    for part in ("draft", "verify", "overhead"):
        assert delta(c, "specd:round_seconds_count", part=part) == rounds
    assert total(after[c], "specd:num_requests_running") == 0
    # The draft proposed what the coordinator verified, and each speculating request's opening call (a model
    # draft: --opening auto opens beside it), which drafted the guess of the first token and K more; the
    # rounds that verified those K (pipeline hits: none of these calls pipelines otherwise) drew no call.
    ks = [
        kw["draft_length"] for kw in [*CALLS, {"speculation": "fixed", "draft_length": 4}] if kw["speculation"] != "off"
    ]
    hits = [s.pipeline_hits for s in stats if s.draft_tokens]
    assert len(hits) == len(ks) and all(h <= 1 for h in hits)
    calls_made = drafts - sum(hits) + len(ks)
    assert delta("draft", "specd:draft_requests_total", op="propose", result="ok") == calls_made
    opening_tokens = sum(k + 1 for k in ks) - sum(h * k for h, k in zip(hits, ks))
    assert delta("draft", "specd:draft_proposed_tokens_total") == draft_tokens + opening_tokens
    assert delta("draft", "specd:draft_propose_seconds_count") == calls_made
    assert delta("target", "specd:target_requests_total", op="verify", result="ok") == rounds
    assert delta("target", "specd:target_verified_draft_tokens_total") == draft_tokens
    assert delta("target", "specd:target_accepted_tokens_total") == accepted
    assert delta("target", "specd:target_verdicts_total") == rounds
    assert delta("target", "specd:target_requests_total", op="open", result="ok") == len(calls)
    # Sessions are closed in the background after each request: both services drain to 0.
    deadline = time.monotonic() + 10
    while any(total(scrape(addresses[s]), "specd:sessions_active") for s in ("draft", "target")):
        assert time.monotonic() < deadline, "sessions were not closed"
        time.sleep(0.1)


def test_unreachable_collector_adds_no_latency(traced: Cluster, receiver: OtlpReceiver) -> None:
    """The collector dies (its port now accepts and never answers): requests are as fast as with tracing off.

    The baseline is a second coordinator without tracing on the same draft and target: it sends
    no trace context, so no service opens a span. Runs last in this module: it takes the receiver away.
    """
    assert traced.coordinator is not None and traced.draft is not None
    args = list(traced.coordinator.args)
    i = args.index("--otlp-endpoint")
    off = QuietService("coordinator-off", args[:i] + args[i + 2 :])
    off.start(traced.env)
    try:
        off.wait_ready(READY_TIMEOUT_S)
        assert not any("tracing on" in line for line in off.lines)
        receiver.stop()
        with socket.socket() as blackhole:
            blackhole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blackhole.bind((receiver.host, receiver.port))
            blackhole.listen(64)  # never accepted: exports hang until their timeout
            workload = [
                dict(max_new_tokens=24, temperature=0, speculation="fixed", draft_length=4, seed=5000 + i)
                for i in range(4)
            ]

            def timed(address: str) -> float:
                start = time.perf_counter()
                for kw in workload:
                    assert generate(address, **kw).response.stats.completion_tokens == 24
                return time.perf_counter() - start

            for address in (off.address or "", traced.address):  # warm up
                generate(address, **workload[0])
            off_s = dead_s = 0.0
            for _ in range(2):  # interleaved, so that load on the machine hits both alike
                off_s += timed(off.address or "")
                dead_s += timed(traced.address)
            assert dead_s < 2 * off_s + 1.0, (dead_s, off_s)
            # Shutting down with spans queued for a dead collector is bounded too.
            services = [off, traced.coordinator, traced.draft, traced.target]
            start = time.perf_counter()
            for service in services:
                service.signal(signal.SIGTERM)
            codes = [s.proc.wait(30) for s in services]  # type: ignore[union-attr]
            assert codes == [0, 0, 0, 0] and time.perf_counter() - start < 20, (codes, traced.logs())
    finally:
        off.stop(grace_s=5.0)
