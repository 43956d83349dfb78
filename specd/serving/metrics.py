"""Prometheus metrics of the three services, each on its own CollectorRegistry.

Names follow vLLM's where one exists, with the `specd:` prefix in place of
`vllm:` (spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos,
request_success, time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, num_requests_running). docs/observability.md
lists them all and the PromQL that derives acceptance rate and length.

The coordinator also exports the model-server metrics of OpenTelemetry's
GenAI conventions under their Prometheus names (specd.serving.genai):
gen_ai_server_request_duration_seconds, gen_ai_server_time_to_first_token_seconds,
gen_ai_server_time_per_output_token_seconds, with the conventions' buckets.

Nothing is global: a service builds its metrics object (with its registry)
at start, hands it to what it creates, and serves the registry with
`specd.serving.metrics_http.serve_metrics`. Per-round work is a handful of counter increments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.core.draft.tenant_index import TenantIndexes
from specd.core.rounds.record import RoundRecord
from specd.core.transit import HOPS
from specd.serving import genai

log = logging.getLogger(__name__)

PREFIX = "specd:"

# Buckets (seconds unless named otherwise); vLLM's ranges plus the sub-10 ms end fast rounds live in.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Fine below 2 ms, where the overhead goals are (p50 <= 0.5 ms): the bench interpolates p50 / p99 within buckets.
ROUND_PART_BUCKETS = (
    0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# Sparse q: bytes one draft position's q takes on the wire, and the time to build it.
Q_BYTES_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384, 32768)
Q_BUILD_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
MAX_ACCEPTANCE_LENGTH_BUCKET = 33  # acceptance length of one round is accepted + 1 <= K + 1

ROUND_PARTS = ("draft", "verify", "overhead")
# Round overhead by hop (specd.core.transit): sub-millisecond resolution, where the goal is.
HOP_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0)


class CoordinatorMetrics:
    """Speculation and request metrics, observed where the rounds run."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Rounds that verified at least one draft token.", registry=r
        )
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based); divide by num_drafts for per-position acceptance.",
            ["position"],
            registry=r,
        )
        self.acceptance_length = Histogram(
            PREFIX + "spec_decode_acceptance_length",
            "Tokens committed per speculative round (accepted + 1); sum/count = 1 + accepted/drafts.",
            buckets=tuple(range(1, MAX_ACCEPTANCE_LENGTH_BUCKET + 1)),
            registry=r,
        )
        self.num_rounds = Counter(
            PREFIX + "spec_decode_num_rounds", "Rounds run (each commits >= 1 token).", registry=r
        )
        self.num_target_only_rounds = Counter(
            PREFIX + "spec_decode_num_target_only_rounds",
            "Rounds that wanted draft tokens but got none (draft down, slow or incompatible).",
            registry=r,
        )
        self.round_seconds = Histogram(
            PREFIX + "round_seconds",
            "Round time split: draft (draft model compute), verify (target compute), overhead (the rest: network, queues, coordinator).",
            ["part"],
            buckets=ROUND_PART_BUCKETS,
            registry=r,
        )
        self.round_hop_seconds = Histogram(
            PREFIX + "round_hop_seconds",
            "Round overhead by hop: per peer (draft, target) queue (stream read to batch start), batch (the "
            "batch's bookkeeping beyond the step's compute), reply (batch end to gRPC), wire (both ways between "
            "the processes), wake (response read to the round resumed); peer coordinator, hop loop: the rest "
            "(the loop, messages, observers). One sample per call.",
            ["peer", "hop"],
            buckets=HOP_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.", ["finished_reason"], registry=r
        )
        self.request_failure = Counter(
            PREFIX + "request_failure",
            "Requests that ended with an error, by error (exception or 'cancelled') and the gRPC status code sent.",
            ["error", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated (committed), counted as each round commits.", registry=r
        )
        self.pipeline_hits = Counter(
            PREFIX + "spec_decode_num_pipeline_hits",
            "Rounds whose drafts were made while the previous round was verified (pipelining), "
            "counted when their request finishes; divide by num_drafts for the hit rate.",
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first committed token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time per output token after the first round: round wall time / tokens it committed, once per round.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token of finished requests.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tokens_per_s = Histogram(
            PREFIX + "request_tokens_per_second",
            "Generated tokens per second of each finished request.",
            buckets=TOKENS_PER_S_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge(PREFIX + "num_requests_running", "Requests being served now.", registry=r)
        # OpenTelemetry GenAI model-server metrics (Prometheus names, the conventions' buckets).
        self.genai_request_duration = Histogram(
            genai.METRIC_REQUEST_DURATION,
            "gen_ai.server.request.duration: arrival to last token, or to the error (error_type = gRPC status code).",
            [*genai.LABELS, genai.LABEL_ERROR_TYPE],
            buckets=genai.REQUEST_DURATION_BUCKETS,
            registry=r,
        )
        self.genai_ttft = Histogram(
            genai.METRIC_TIME_TO_FIRST_TOKEN,
            "gen_ai.server.time_to_first_token: arrival to the first committed token, successful requests.",
            genai.LABELS,
            buckets=genai.TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.genai_tpot = Histogram(
            genai.METRIC_TIME_PER_OUTPUT_TOKEN,
            "gen_ai.server.time_per_output_token: (request duration - time to first token) / (output tokens - 1), "
            "successful requests with more than one output token.",
            genai.LABELS,
            buckets=genai.TIME_PER_OUTPUT_TOKEN_BUCKETS,
            registry=r,
        )
        self._parts = [self.round_seconds.labels(part=p) for p in ROUND_PARTS]
        self._hops = {
            (peer, hop): self.round_hop_seconds.labels(peer=peer, hop=hop)
            for peer in ("draft", "target")
            for hop in HOPS
        }
        self._loop_hop = self.round_hop_seconds.labels(peer="coordinator", hop="loop")
        self._positions: list[Any] = []  # accepted_per_pos children by position

    def watch_requests(self, count: Callable[[], float]) -> None:
        """num_requests_running reads `count()` at scrape time (no per-request work)."""
        self.requests_running.set_function(count)

    def observe_round(self, record: RoundRecord) -> None:
        """One committed round (its tokens counted after the stop rules)."""
        self.num_rounds.inc()
        self.generation_tokens.inc(record.tokens)
        if record.fallback:
            self.num_target_only_rounds.inc()
        drafted, accepted = record.draft_tokens, record.accepted
        if drafted > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            self.acceptance_length.observe(accepted + 1)
            while len(self._positions) < drafted:  # positions appear (at 0) once drafted
                self._positions.append(self.accepted_per_pos.labels(position=str(len(self._positions))))
            for i in range(accepted):
                self._positions[i].inc()
        for child, ms in zip(self._parts, (record.draft_ms, record.verify_ms, record.overhead_ms)):
            child.observe(max(0.0, ms) / 1e3)
        if record.index > 0 and record.tokens > 0:  # the first round's tokens are time to first token
            self.itl.observe(record.wall_ms / 1e3 / record.tokens)
        for peer, transit in (("draft", record.draft_transit), ("target", record.verify_transit)):
            if transit is not None:
                for hop, ms in transit.hops():
                    self._hops[peer, hop].observe(ms / 1e3)
        loop_ms = record.loop_ms
        if loop_ms is not None:
            self._loop_hop.observe(loop_ms / 1e3)

    def observe_request(self, stats: Any, finish_reason: str, e2e_s: float, *, model: str = "") -> None:
        """A finished request (specd.core.rounds.record.RequestStats); model: the target's name (gen_ai.request.model)."""
        ttft_s = stats.time_to_first_token_ms / 1e3
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.pipeline_hits.inc(stats.rounds.pipeline_hits)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.tokens_per_s.observe(stats.tokens_per_s)
        labels = _genai_labels(model)
        self.genai_request_duration.labels(*labels, "").observe(e2e_s)
        self.genai_ttft.labels(*labels).observe(ttft_s)
        if stats.completion_tokens > 1:
            self.genai_tpot.labels(*labels).observe(max(0.0, e2e_s - ttft_s) / (stats.completion_tokens - 1))

    def observe_failure(self, error: str, code: str, e2e_s: float | None = None, *, model: str = "") -> None:
        """A request ended by an error: `error` names it, `code` is the gRPC status code name the client got."""
        self.request_failure.labels(error=error, code=code).inc()
        if e2e_s is not None:
            self.genai_request_duration.labels(*_genai_labels(model), code).observe(e2e_s)


def _genai_labels(model: str) -> tuple[str, str, str]:
    """Values of genai.LABELS: operation, provider, requested model."""
    return genai.OPERATION, genai.PROVIDER, model


class _ModelServiceMetrics:
    """What the draft and target services share: messages by op and result, sessions held."""

    service = ""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}{self.service}_requests",
            f"Round-stream messages the {self.service} handled, by op (open, propose/verify, close) and result "
            "(ok or the in-band error code).",
            ["op", "result"],
            registry=self.registry,
        )
        self.sessions = Gauge(PREFIX + "sessions_active", "Sessions (KV caches) held now.", registry=self.registry)
        self.kv_bytes = Gauge(
            PREFIX + "kv_cache_bytes",
            "Bytes of the KV caches of the sessions held now (this process's share under tensor parallelism; "
            "0 for a drafter without a model).",
            registry=self.registry,
        )
        self.batch_size = Histogram(
            f"{PREFIX}{self.service}_batch_size",
            f"Sessions sharing the forward pass(es) of a {self.service} step (one sample per step).",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )

    def watch_sessions(self, count: Callable[[], float], kv_bytes: Callable[[], float] | None = None) -> None:
        """sessions_active reads `count()`, kv_cache_bytes `kv_bytes()` (if given) at scrape time."""
        self.sessions.set_function(count)
        if kv_bytes is not None:
            self.kv_bytes.set_function(_read_while_changing(kv_bytes))

    def observe_message(self, op: str, result: str) -> None:
        self.requests.labels(op=op, result=result).inc()


class DraftMetrics(_ModelServiceMetrics):
    service = "draft"

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.proposed_tokens = Counter(PREFIX + "draft_proposed_tokens", "Draft tokens proposed.", registry=r)
        self.propose_seconds = Histogram(
            PREFIX + "draft_propose_seconds",
            "Draft model time per propose (K forward passes and sampling).",
            buckets=ROUND_PART_BUCKETS,
            registry=r,
        )

        self.q_bytes = Histogram(
            PREFIX + "draft_q_bytes",
            "Wire bytes of the sparse q of one draft token (one sample per sampled draft token; "
            "greedy and n-gram drafts send none).",
            buckets=Q_BYTES_BUCKETS,
            registry=r,
        )
        self.q_build_seconds = Histogram(
            PREFIX + "draft_q_build_seconds",
            "Draft time per propose spent building the sparse q and sampling from it "
            "(part of draft_propose_seconds; a batch's shared build counts whole).",
            buckets=Q_BUILD_BUCKETS,
            registry=r,
        )

    def watch_suffix_index(self, learned: TenantIndexes) -> None:
        """The suffix drafter's learned indexes (all tenants'): memory against the budget, tokens, documents."""
        r = self.registry
        for name, doc, read in (
            ("bytes", "Bytes held by the suffix drafter's learned indexes (all tenants).", lambda: learned.nbytes),
            (
                "budget_bytes",
                "The learned indexes' memory budget, all tenants together (least recently used tenants dropped beyond).",
                lambda: learned.max_bytes,
            ),
            ("tokens", "Tokens in the suffix drafter's learned indexes.", lambda: learned.tokens),
            ("documents", "Finished sessions held in the suffix drafter's learned indexes.", lambda: learned.documents),
            ("tenants", "Tenants with a learned suffix index.", lambda: learned.tenants),
            (
                "unscoped_sessions",
                "Finished sessions with no tenant (no caller identity, no cache_salt), not learnt.",
                lambda: learned.unscoped_documents,
            ),
        ):
            Gauge(PREFIX + "draft_suffix_index_" + name, doc, registry=r).set_function(read)

    def observe_propose(self, tokens: int, compute_ms: float, batch_size: int = 1) -> None:
        self.proposed_tokens.inc(tokens)
        self.propose_seconds.observe(compute_ms / 1e3)
        self.batch_size.observe(batch_size)

    def observe_q(self, bytes_per_token: Sequence[int], build_ms: float) -> None:
        """A propose that sent q: each draft token's q bytes, and the time its q took."""
        for n in bytes_per_token:
            self.q_bytes.observe(n)
        self.q_build_seconds.observe(build_ms / 1e3)


class TargetMetrics(_ModelServiceMetrics):
    service = "target"

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.verified_draft_tokens = Counter(
            PREFIX + "target_verified_draft_tokens", "Draft tokens verified by the target.", registry=r
        )
        self.accepted_tokens = Counter(
            PREFIX + "target_accepted_tokens", "Draft tokens the target accepted.", registry=r
        )
        self.verdicts = Counter(
            PREFIX + "target_verdicts",
            "Verify verdicts by the kind of the extra token (recovered or bonus).",
            ["kind"],
            registry=r,
        )
        self.verify_seconds = Histogram(
            PREFIX + "target_verify_seconds",
            "Target model time per verify (forward pass, sampling, roll-back).",
            buckets=ROUND_PART_BUCKETS,
            registry=r,
        )

    def observe_verify(
        self, draft_tokens: int, accepted: int, kind: str, compute_ms: float, batch_size: int = 1
    ) -> None:
        self.verified_draft_tokens.inc(draft_tokens)
        self.accepted_tokens.inc(accepted)
        self.verdicts.labels(kind=kind).inc()
        self.verify_seconds.observe(compute_ms / 1e3)
        self.batch_size.observe(batch_size)


def _read_while_changing(read: Callable[[], float], tries: int = 3) -> Callable[[], float]:
    """`read` for a scrape thread while the model thread changes what it reads.

    Summing over a session table that gains or loses a session mid-way raises
    RuntimeError (dict changed size); try again, and report the last good
    value rather than fail the scrape.
    """
    last = [0.0]

    def guarded() -> float:
        for _ in range(tries):
            try:
                last[0] = float(read())
                break
            except RuntimeError:
                continue
        return last[0]

    return guarded
