"""Typed, validated settings: one dataclass per service, built once from flags.

Each field becomes a flag ``--field-name``; a container may set its default
through the environment as ``SPECD_FIELD_NAME`` (parsed in specd.serving.flags).
Defaults live in the dataclasses only.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.core.draft.suffix import SuffixSettings
from specd.core.errors import InvalidArgument
from specd.core.model.catalog import DEMO, NONE
from specd.core.model.cpu_linear import CPU_LINEARS
from specd.core.rounds.auto import PIPELINE_AUTO
from specd.core.rounds.pipeline import PIPELINES
from specd.core.rounds.spec import OPENING_AUTO, OPENINGS
from specd.core.rounds.steps import DEFAULT_BRANCH_BUDGET, MAX_BRANCH_BUDGET
from specd.core.sampling.sparse_q import MAX_BITS, QSettings
from specd.serving.batching import FRUITLESS_RUN, FRUITLESS_SKIP

MAX_CONNECTION_TIMER_S = 2_147_483  # gRPC's connection timers are int milliseconds
MAX_MALLOC_KEEP_MIB = 1024  # a bound on a typo; glibc itself may refuse less (then its defaults stay, logged)


def default_cache_dir() -> Path:
    """Where converted and assembled models live (SPECD_CACHE_DIR or ~/.cache/specd)."""
    return Path(os.environ.get("SPECD_CACHE_DIR") or Path.home() / ".cache" / "specd")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServiceBase:
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 in containers)")
    port: int = _opt(0, "gRPC port (0 picks a free one and prints it)")
    torch_threads: int = _opt(0, "torch intra-op threads (0: torch's default)")
    log_level: str = _opt("INFO", "logging level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    grace_s: float = _opt(10.0, "seconds in-flight calls get to finish on SIGTERM")
    metrics_port: int = _opt(-1, "Prometheus metrics HTTP port (-1 off, 0 picks a free one)")
    otlp_endpoint: str = _opt(
        "", "OTLP trace endpoint, e.g. http://jaeger:4317 (empty: OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off)"
    )
    otlp_protocol: str = _opt("grpc", "OTLP transport", choices=["grpc", "http/protobuf"])
    trace_sample_ratio: float = _opt(1.0, "fraction of requests traced, 0..1")
    tls_cert: str = _opt("", "server certificate chain (PEM); with --tls-key turns TLS on")
    tls_key: str = _opt("", "server private key (PEM)")
    tls_client_ca: str = _opt("", "CA bundle (PEM) that client certificates must chain to (mutual TLS)")
    tls_client_names: str = _opt(
        "",
        "comma-separated names (subject CN or DNS SAN) a client certificate must carry, e.g. the coordinator's; "
        "empty: any certificate from --tls-client-ca",
    )
    max_concurrent_rpcs: int = _opt(1024, "calls served at once, all kinds; more get RESOURCE_EXHAUSTED at once")
    max_streams_per_connection: int = _opt(128, "streams one client connection may hold open at once")
    gil_switch_ms: float = _opt(
        1.0,
        "how long a Python thread may hold the GIL while another waits for it (sys.setswitchinterval; Python's "
        "default is 5): the gRPC poller and the event loop wait at most this for a busy model or loop thread",
    )
    malloc_keep_mib: int = _opt(
        32,
        "host buffers up to this many MiB are reused from the heap after they are freed instead of being mapped "
        "and faulted in afresh on every allocation (glibc's M_MMAP_THRESHOLD; twice it is kept free at the heap's "
        "top); 0: the C library's defaults",
    )
    event_loop: str = _opt(
        "auto",
        "the service's event loop: uvloop (libuv, a loop in C: less CPU per stream message), asyncio, or auto "
        "(uvloop where it is installed)",
        choices=["auto", "uvloop", "asyncio"],
    )
    max_connection_idle_s: float = _opt(
        300.0, "a client connection with no call open this long is closed (GOAWAY; the client reconnects); 0: never"
    )
    max_connection_age_s: float = _opt(
        -1.0,
        "a client connection is told to go away (GOAWAY) after this long, so clients spread over replicas again; "
        "-1: 1800 on the coordinator, off on draft and target (their one client holds its round streams for its "
        "life: an age would cut them); 0: never",
    )
    max_connection_age_grace_s: float = _opt(
        310.0,
        "after --max-connection-age-s, calls still open get this long to finish before the connection is closed "
        "(keep it above the coordinator's --request-timeout-s)",
    )
    handshake_timeout_s: float = _opt(
        10.0, "a new connection that has not finished its TLS and HTTP/2 handshake within this is closed"
    )

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--port must be in 0..65535 (got {self.port})")
        if self.torch_threads < 0:
            raise InvalidArgument(f"--torch-threads must be >= 0 (got {self.torch_threads})")
        if self.grace_s < 0:
            raise InvalidArgument("--grace-s must be >= 0")
        if not 0.01 <= self.gil_switch_ms <= 100:
            raise InvalidArgument(f"--gil-switch-ms must be in [0.01, 100] (got {self.gil_switch_ms})")
        if not 0 <= self.malloc_keep_mib <= MAX_MALLOC_KEEP_MIB:
            raise InvalidArgument(f"--malloc-keep-mib must be in 0..{MAX_MALLOC_KEEP_MIB} (got {self.malloc_keep_mib})")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"--metrics-port must be -1 (off) or in 0..65535 (got {self.metrics_port})")
        if self.max_concurrent_rpcs < 1 or self.max_streams_per_connection < 1:
            raise InvalidArgument("--max-concurrent-rpcs and --max-streams-per-connection must be >= 1")
        for f in dataclasses.fields(self):  # every float setting of every service
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidArgument(f"--{f.name.replace('_', '-')} must be a finite number (got {value})")
        # gRPC takes these as int milliseconds: at most 2**31 - 1 ms (24.8 days).
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_connection_age_grace_s"):
            value = getattr(self, name)
            if not (0 <= value <= MAX_CONNECTION_TIMER_S or (name == "max_connection_age_s" and value == -1)):
                auto = " or -1 (the service's default)" if name == "max_connection_age_s" else ""
                raise InvalidArgument(
                    f"--{name.replace('_', '-')} must be in 0..{MAX_CONNECTION_TIMER_S} seconds{auto} (got {value})"
                )
        if not 0 < self.handshake_timeout_s <= MAX_CONNECTION_TIMER_S:
            raise InvalidArgument(
                f"--handshake-timeout-s must be in (0, {MAX_CONNECTION_TIMER_S}] seconds (got {self.handshake_timeout_s})"
            )
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise InvalidArgument(f"--trace-sample-ratio must be in [0, 1] (got {self.trace_sample_ratio})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_names and not self.tls_client_ca:
            raise InvalidArgument("--tls-client-names needs --tls-client-ca (mutual TLS)")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise InvalidArgument(f"--{name.replace('_', '-')} {path!r} is not a readable file")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def client_names(self) -> list[str]:
        return [n.strip() for n in self.tls_client_names.split(",") if n.strip()]


@dataclass(frozen=True)
class ModelServiceBase(ServiceBase):
    cache_dir: str = _opt("", "model cache folder (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    device: str = _opt("cpu", "torch device (cpu, cuda, cuda:0, ...)")
    cpu_linear: str = _opt(
        CPU_LINEARS[0],
        "linear layers on CPU: packed (1-3 rows by the few-row kernel, more on a oneDNN-packed copy of the weights: "
        "the fastest verifies and prefills, twice the linear weights' memory), few-row (1-8 rows by the few-row "
        "kernel, no copy) or torch (torch's own); the few-row kernel is (W @ x.T).T, or torch's own on an Intel CPU, "
        "where MKL's is the faster",
        choices=list(CPU_LINEARS),
    )
    max_sessions: int = _opt(256, "sessions held at once; more get RESOURCE_EXHAUSTED")
    idle_timeout_s: float = _opt(600.0, "sessions unused this long are dropped")
    max_kv_bytes: int = _opt(
        0,
        "KV-cache bytes all sessions may hold; 0: on CUDA derived from --kv-memory-fraction, elsewhere no limit",
    )
    kv_memory_fraction: float = _opt(
        0.9,
        "on CUDA with --max-kv-bytes 0: the share of the device memory free after the model loaded that this "
        "service may use (as vLLM's gpu_memory_utilization); the KV budget is that less a forward's activations, "
        "halved (a batched pass briefly copies the caches); unused elsewhere",
    )
    max_batch: int = _opt(32, "sessions whose steps share one forward pass (1: no batching)")
    batch_wait_ms: float = _opt(
        3.0,
        "a batch smaller than the sessions held waits up to this long for their steps (after "
        f"{FRUITLESS_RUN} waits in a row that merged nobody, the next {FRUITLESS_SKIP} batches do not wait)",
    )

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def validate(self) -> None:
        super().validate()
        if self.max_sessions < 1:
            raise InvalidArgument(f"--max-sessions must be >= 1 (got {self.max_sessions})")
        if self.idle_timeout_s <= 0:
            raise InvalidArgument("--idle-timeout-s must be > 0")
        if self.max_kv_bytes < 0:
            raise InvalidArgument("--max-kv-bytes must be >= 0")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise InvalidArgument(f"--kv-memory-fraction must be in (0, 1] (got {self.kv_memory_fraction})")
        if self.batch_wait_ms < 0:
            raise InvalidArgument(f"--batch-wait-ms must be >= 0 (got {self.batch_wait_ms})")
        if self.max_batch < 1:
            raise InvalidArgument(f"--max-batch must be >= 1 (got {self.max_batch}); 1 turns batching off")


@dataclass(frozen=True)
class DraftConfig(ModelServiceBase):
    model: str = _opt(
        DEMO,
        "draft model: an HF folder, 'demo' (the demo draft), 'ngram', 'suffix', 'suffix+MODEL' "
        "(a draft model, e.g. suffix+demo, with suffix speculation when it scores --hybrid-threshold), "
        "or 'sim:PROFILE' (an emulated accelerator)",
    )
    target_model: str = _opt(DEMO, "the target's model folder ('demo'): used to build the demo draft")
    q_epsilon: float = _opt(
        QSettings.epsilon, "per draft position, send the fewest tokens whose mass reaches 1 - q_epsilon (sparse q)"
    )
    q_max_tokens: int = _opt(QSettings.max_tokens, "at most this many tokens of q per draft position (the budget)")
    wire_bits: int = _opt(QSettings.bits, "q is rounded to integer weights on a 2**-wire_bits grid before sampling")
    wire_top_k: int = _opt(
        0, "legacy: send a fixed top-k of q instead (same as --q-epsilon 0 --q-max-tokens K); 0: by mass"
    )
    max_draft_tokens: int = _opt(32, "largest K a propose may ask for")
    ngram_cap_at_match: bool = _opt(
        True,
        "n-gram drafter: propose at most as many tokens as the context its "
        "match agrees on (--no-ngram-cap-at-match: always K when there are K)",
    )

    suffix_max_depth: int = _opt(24, "suffix drafter: context tokens a match may use")
    suffix_max_spec_factor: float = _opt(1.0, "suffix drafter: propose at most factor x match length (+ offset) tokens")
    suffix_max_spec_offset: float = _opt(0.0, "suffix drafter: see --suffix-max-spec-factor")
    suffix_min_token_prob: float = _opt(
        0.1, "suffix drafter: stop where a continuation's estimated probability drops below this"
    )
    suffix_index_bytes: int = _opt(
        64 << 20,
        "suffix drafter: memory of all learned indexes of finished sessions together "
        "(beyond it the least recently used tenants' indexes are dropped)",
    )
    suffix_tenant_index_bytes: int = _opt(
        16 << 20, "suffix drafter: memory of one tenant's learned index (its oldest sessions evicted beyond)"
    )
    suffix_sharing: str = _opt(
        "tenant",
        "suffix drafter: 'tenant': what finished sessions taught is proposed only to the same tenant "
        "(caller identity + cache_salt; callers with neither learn nothing across requests); "
        "'shared': one index for every caller (single-tenant deployments only: "
        "any caller can probe what others' requests contained)",
        choices=["tenant", "shared"],
    )
    suffix_max_tenants: int = _opt(
        1024, "suffix drafter: learned tenant indexes kept at most (least recently used dropped)"
    )
    suffix_prompt_tail: int = _opt(
        24, "suffix drafter: prompt tokens kept before each output in the learned index (-1: the whole prompt)"
    )
    suffix_fallback: str = _opt(
        "ngram", "suffix drafter: what proposes when its indexes have nothing", choices=["ngram", "none"]
    )
    hybrid_threshold: float = _opt(
        1.0, "suffix+MODEL: the suffix proposal's score (expected accepted tokens) that beats the model"
    )
    hybrid_adaptive_k: bool = _opt(
        True,
        "suffix+MODEL: the model drafts the K that its own measured acceptance and cost make best, "
        "none when no K pays (--no-hybrid-adaptive-k: the K asked for)",
    )

    def suffix_settings(self) -> SuffixSettings:
        return SuffixSettings(
            max_depth=self.suffix_max_depth,
            max_spec_factor=self.suffix_max_spec_factor,
            max_spec_offset=self.suffix_max_spec_offset,
            min_token_prob=self.suffix_min_token_prob,
            index_bytes=self.suffix_index_bytes,
            tenant_index_bytes=self.suffix_tenant_index_bytes,
            sharing=self.suffix_sharing,
            max_tenants=self.suffix_max_tenants,
            prompt_tail=self.suffix_prompt_tail,
            fallback=self.suffix_fallback,
        )

    @property
    def q_settings(self) -> QSettings:
        """How a model draft builds its sparse q (a fixed top-k when --wire-top-k is set)."""
        if self.wire_top_k:
            return QSettings.top_k(self.wire_top_k, self.wire_bits)
        return QSettings(epsilon=self.q_epsilon, max_tokens=self.q_max_tokens, bits=self.wire_bits)

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.q_epsilon < 1.0:
            raise InvalidArgument(f"--q-epsilon must be in [0, 1) (got {self.q_epsilon})")
        if self.q_max_tokens < 1:
            raise InvalidArgument(f"--q-max-tokens must be >= 1 (got {self.q_max_tokens})")
        if self.wire_top_k < 0:
            raise InvalidArgument(f"--wire-top-k must be >= 0 (got {self.wire_top_k}); 0 sends q by mass")
        if not 1 <= self.wire_bits <= MAX_BITS:
            raise InvalidArgument(f"--wire-bits must be in 1..{MAX_BITS} (got {self.wire_bits})")
        self.suffix_settings().validate()
        if self.hybrid_threshold < 0:
            raise InvalidArgument(f"--hybrid-threshold must be >= 0 (got {self.hybrid_threshold})")
        if self.max_draft_tokens < 1:
            raise InvalidArgument("--max-draft-tokens must be >= 1")


@dataclass(frozen=True)
class TargetConfig(ModelServiceBase):
    model: str = _opt(
        DEMO, "target model: an HF folder, 'demo' (SmolLM2-135M-Instruct) or 'sim:PROFILE' (emulated accelerator)"
    )
    tp: int = _opt(1, "tensor-parallel workers (ranks); each holds 1/tp of the sharded weights")
    executor: str = _opt("mp", "how tp > 1 workers run: local processes or Ray actors", choices=["mp", "ray"])
    ray_address: str = _opt("", "Ray cluster to join (empty: start a local Ray)")
    worker_ready_timeout_s: float = _opt(300.0, "how long to wait for all tp workers to load")
    exit_on_worker_failure: bool = _opt(
        False, "exit (for Kubernetes to restart) instead of restarting the worker group"
    )
    max_draft_tokens: int = _opt(32, "largest K a verify may carry (the coordinator's --max-draft-length must fit)")
    max_q_width: int = _opt(
        4096, "most q entries per draft position a verify may carry (the draft's wire top-k must fit)"
    )

    def validate(self) -> None:
        super().validate()
        if self.max_draft_tokens < 1 or self.max_q_width < 1:
            raise InvalidArgument("--max-draft-tokens and --max-q-width must be >= 1")
        if self.tp < 1:
            raise InvalidArgument(f"--tp must be >= 1 (got {self.tp})")
        if self.worker_ready_timeout_s <= 0:
            raise InvalidArgument("--worker-ready-timeout-s must be > 0")


@dataclass(frozen=True)
class CoordinatorConfig(ServiceBase):
    target: str = _opt(
        "127.0.0.1:50053",
        "target replicas: HOST:PORT, a comma-separated list, or dns:///NAME:PORT (every address NAME resolves to)",
    )
    draft: str = _opt("127.0.0.1:50052", "draft replicas, as --target; or 'none'")
    resolve_interval_s: float = _opt(5.0, "re-resolve dns:/// peer names this often (replicas come and go)")
    replica_poll_s: float = _opt(1.0, "ask each replica for its health and load this often")
    tokenizer: str = _opt(DEMO, "tokenizer folder (the target's model folder), 'demo' or the target's 'sim:PROFILE'")
    cache_dir: str = _opt("", "model cache folder (for the demo tokenizer)")
    draft_length: int = _opt(4, "draft tokens per round when speculation is fixed or automatic")
    max_draft_length: int = _opt(16, "largest draft length a request may ask for")
    max_tree_budget: int = _opt(
        32, "largest tree node budget a request may ask for (the draft's and target's --max-draft-tokens must fit)"
    )
    speculation: str = _opt("auto", "default speculation mode", choices=["auto", "fixed", "off"])
    pipeline: str = _opt(
        PIPELINE_AUTO,
        "default pipelining: draft the next round during verification; 'auto' chooses per round, with K, "
        "for automatic speculation (a fixed-K request without a pipeline of its own runs 'off')",
        choices=sorted([*PIPELINES, PIPELINE_AUTO]),
    )
    branch_budget: int = _opt(
        DEFAULT_BRANCH_BUDGET,
        "spec-cache pipelining: the likeliest verdicts of each round the draft pre-drafts the next round for "
        f"(one batched pass; 1..{MAX_BRANCH_BUDGET}); the most, with --adapt-branch-budget",
    )
    adapt_branch_budget: bool = _opt(
        True,
        "spec-cache pipelining: per round, as few branches as pay (measured: the branch call's and the "
        "verify's latency, the hits; --no-adapt-branch-budget: always --branch-budget)",
    )
    opening: str = _opt(
        OPENING_AUTO,
        "a speculating request's first round: 'beside' prefills the target alone while the draft's first "
        "call (its prefill, a guess of the first token, K more) runs beside it (the first token waits for "
        "no draft); 'draft-first' drafts, then verifies the prompt with the drafts; 'auto': beside for "
        "a model draft, draft-first for n-gram and suffix drafts (nothing to hide)",
        choices=[OPENING_AUTO, *OPENINGS],
    )
    default_max_new_tokens: int = _opt(128, "max_new_tokens when a request sets none")
    max_new_tokens_limit: int = _opt(4096, "largest max_new_tokens a request may ask for")
    max_concurrent_requests: int = _opt(64, "requests served at once; more get RESOURCE_EXHAUSTED")
    max_active_tokens: int = _opt(
        0,
        "prompt + max_new_tokens of all requests served at once; more get RESOURCE_EXHAUSTED "
        "(0: no limit; size it to the target's --max-kv-bytes / KV bytes per token)",
    )
    max_stop_strings: int = _opt(16, "stop strings a request may give")
    max_stop_token_ids: int = _opt(64, "stop token IDs a request may give")
    max_chat_messages: int = _opt(512, "chat messages a request may give")
    max_prompt_chars: int = _opt(
        0, "longest prompt text (or chat content) accepted; 0: 32 characters per token of the model's context"
    )
    tokenizer_threads: int = _opt(
        1,
        "threads that tokenize prompts and render chat templates, off the event loop "
        "(requests waiting for one count against --max-concurrent-requests)",
    )
    draft_timeout_s: float = _opt(5.0, "a draft answer later than this falls back to target-only")
    target_timeout_s: float = _opt(30.0, "a target answer later than this fails the round")
    request_timeout_s: float = _opt(300.0, "deadline for requests that carry none")
    draft_retry_s: float = _opt(2.0, "after a draft failure, speculate again after this long")
    api_token_file: str = _opt("", "file holding the bearer token clients must send (empty: no token)")
    api_token_grace_s: float = _opt(
        300.0, "after the token file changes, the previous token stays valid this long (clients switch over)"
    )
    allow_plaintext_token: bool = _opt(
        False,
        "accept the API token without TLS on a non-loopback address (only behind a proxy or mesh that encrypts)",
    )
    peer_tls_ca: str = _opt("", "CA bundle (PEM) to verify draft and target certificates (turns TLS on to peers)")
    peer_tls_cert: str = _opt("", "client certificate (PEM) for mutual TLS to draft and target")
    peer_tls_key: str = _opt("", "client private key (PEM) for mutual TLS to draft and target")
    peer_tls_server_name: str = _opt("", "name to verify in peer certificates (default: the address host)")
    http_port: int = _opt(
        -1,
        "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, /health) on --host, "
        "with the same TLS and API token as the gRPC port (-1 off, 0 picks a free one and prints it)",
    )
    served_model_name: str = _opt(
        "",
        "the model's name on the OpenAI API (comma-separated: aliases; requests may name any of them); "
        "empty: the target's own name",
    )

    @property
    def served_model_names(self) -> list[str]:
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()]

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    @property
    def draft_address(self) -> str | None:
        return None if self.draft in ("", NONE) else self.draft

    def validate(self) -> None:
        super().validate()
        if self.draft_length < 1 or self.max_draft_length < self.draft_length:
            raise InvalidArgument("need 1 <= --draft-length <= --max-draft-length")
        if self.max_tree_budget < 1:
            raise InvalidArgument("--max-tree-budget must be >= 1")
        if not 1 <= self.branch_budget <= MAX_BRANCH_BUDGET:
            raise InvalidArgument(f"--branch-budget must be in 1..{MAX_BRANCH_BUDGET}")
        if self.opening not in (OPENING_AUTO, *OPENINGS):
            raise InvalidArgument(
                f"--opening must be one of {OPENING_AUTO}, {', '.join(OPENINGS)} (got {self.opening!r})"
            )
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise InvalidArgument("need 1 <= --default-max-new-tokens <= --max-new-tokens-limit")
        for name in (
            "max_concurrent_requests",
            "max_stop_strings",
            "max_stop_token_ids",
            "max_chat_messages",
            "tokenizer_threads",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")
        if self.api_token_grace_s < 0:
            raise InvalidArgument("--api-token-grace-s must be >= 0")
        if self.max_active_tokens < 0:
            raise InvalidArgument("--max-active-tokens must be >= 0 (0: no limit)")
        if self.max_prompt_chars < 0:
            raise InvalidArgument("--max-prompt-chars must be >= 0 (0: from the model's context)")
        for name in (
            "draft_timeout_s",
            "target_timeout_s",
            "request_timeout_s",
            "draft_retry_s",
            "resolve_interval_s",
            "replica_poll_s",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be > 0")
        if bool(self.peer_tls_cert) != bool(self.peer_tls_key):
            raise InvalidArgument("mutual TLS to peers needs both --peer-tls-cert and --peer-tls-key")
        if self.peer_tls_cert and not self.peer_tls_ca:
            raise InvalidArgument("--peer-tls-cert needs --peer-tls-ca (TLS to peers)")
        if self.api_token_file and not self.tls_enabled and not self.allow_plaintext_token and not _loopback(self.host):
            raise InvalidArgument(
                f"--api-token-file without TLS on {self.host}: the token would cross the network in clear; "
                "add --tls-cert/--tls-key, listen on 127.0.0.1, or pass --allow-plaintext-token behind an "
                "encrypting proxy"
            )
        for name in ("api_token_file", "peer_tls_ca", "peer_tls_cert", "peer_tls_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise InvalidArgument(f"--{name.replace('_', '-')} {path!r} is not a readable file")
        if not -1 <= self.http_port <= 65535:
            raise InvalidArgument(f"--http-port must be -1 (off) or in 0..65535 (got {self.http_port})")
        if self.http_port >= 0 and self.client_names:
            raise InvalidArgument(
                "--http-port with --tls-client-names: the HTTP port cannot check client certificate names; "
                "drop --tls-client-names (any certificate from --tls-client-ca), or use the API token"
            )


def _loopback(host: str) -> bool:
    """Whether a listen address is reachable only from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
