"""Prometheus metrics of the three services, each on its own CollectorRegistry.

Names follow vLLM's where one exists, with the `specd:` prefix in place of
`vllm:` (spec_decode_num_drafts, spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos,
request_success, time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, num_requests_running). docs/observability.md
lists them all and the PromQL that derives acceptance rate and length.

Nothing is global: a service builds its metrics object (with its registry)
at start, hands it to what it creates, and serves the registry with
`serve_metrics`. Per-round work is a handful of counter increments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specd.core.suffix_index import SharedSuffixIndex

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
ROUND_PART_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
MAX_ACCEPTANCE_LENGTH_BUCKET = 33  # acceptance length of one round is accepted + 1 <= K + 1

ROUND_PARTS = ("draft", "verify", "overhead")


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
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.", ["finished_reason"], registry=r
        )
        self.request_failure = Counter(
            PREFIX + "request_failure", "Requests that ended with an error, by error.", ["error"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (committed).", registry=r)
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
        self._parts = [self.round_seconds.labels(part=p) for p in ROUND_PARTS]
        self._positions: list[Any] = []  # accepted_per_pos children by position

    def watch_requests(self, count: Callable[[], float]) -> None:
        """num_requests_running reads `count()` at scrape time (no per-request work)."""
        self.requests_running.set_function(count)

    def observe_round(
        self,
        *,
        index: int,
        draft_tokens: int,
        accepted: int,
        target_only: bool,
        tokens: int,
        draft_ms: float,
        verify_ms: float,
        overhead_ms: float,
        wall_ms: float,
    ) -> None:
        """One committed round (`tokens` committed after the stop rules)."""
        self.num_rounds.inc()
        if target_only:
            self.num_target_only_rounds.inc()
        if draft_tokens > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(draft_tokens)
            self.num_accepted_tokens.inc(accepted)
            self.acceptance_length.observe(accepted + 1)
            while len(self._positions) < draft_tokens:  # positions appear (at 0) once drafted
                self._positions.append(self.accepted_per_pos.labels(position=str(len(self._positions))))
            for i in range(accepted):
                self._positions[i].inc()
        for child, ms in zip(self._parts, (draft_ms, verify_ms, overhead_ms)):
            child.observe(max(0.0, ms) / 1e3)
        if index > 0 and tokens > 0:  # the first round's tokens are time to first token
            self.itl.observe(wall_ms / 1e3 / tokens)

    def observe_request(self, stats: Any, finish_reason: str, e2e_s: float) -> None:
        """A finished request (coordinator.engine.RequestStats)."""
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.ttft.observe(stats.time_to_first_token_ms / 1e3)
        self.e2e.observe(e2e_s)
        self.tokens_per_s.observe(stats.tokens_per_s)

    def observe_failure(self, error: str) -> None:
        self.request_failure.labels(error=error).inc()


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
        self.batch_size = Histogram(
            f"{PREFIX}{self.service}_batch_size",
            f"Sessions sharing the forward pass(es) of a {self.service} step (one sample per step).",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )

    def watch_sessions(self, count: Callable[[], float]) -> None:
        """sessions_active reads `count()` at scrape time."""
        self.sessions.set_function(count)

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

    def watch_suffix_index(self, index: SharedSuffixIndex) -> None:
        """The suffix drafter's global index: its memory against the budget, its tokens and documents."""
        r = self.registry
        for name, doc, read in (
            ("bytes", "Bytes held by the suffix drafter's global index.", lambda: index.nbytes),
            (
                "budget_bytes",
                "The global index's memory budget (oldest sessions evicted beyond).",
                lambda: index.max_bytes,
            ),
            ("tokens", "Tokens in the suffix drafter's global index.", lambda: index.tokens),
            ("documents", "Finished sessions held in the suffix drafter's global index.", lambda: index.documents),
        ):
            Gauge(PREFIX + "draft_suffix_index_" + name, doc, registry=r).set_function(read)

    def observe_propose(self, tokens: int, compute_ms: float, batch_size: int = 1) -> None:
        self.proposed_tokens.inc(tokens)
        self.propose_seconds.observe(compute_ms / 1e3)
        self.batch_size.observe(batch_size)


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


def metrics_for(service: str) -> CoordinatorMetrics | DraftMetrics | TargetMetrics:
    return {"coordinator": CoordinatorMetrics, "draft": DraftMetrics, "target": TargetMetrics}[service]()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve `registry` as Prometheus text on http://host:port/metrics (port 0 picks one).

    Returns (server, port); call server.shutdown() to stop. The server runs
    in its own daemon thread, so scrapes never touch the event loop.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
