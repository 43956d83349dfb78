"""Typed, validated settings: one dataclass per service, built once from flags.

Each field becomes a flag ``--field-name``; a container may set its default
through the environment as ``SPECD_FIELD_NAME`` (read here and nowhere else).
Defaults live in the dataclasses only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from specd.core.catalog import DEMO, NONE
from specd.core.errors import InvalidArgument

C = TypeVar("C")


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

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--port must be in 0..65535 (got {self.port})")
        if self.torch_threads < 0:
            raise InvalidArgument(f"--torch-threads must be >= 0 (got {self.torch_threads})")
        if self.grace_s < 0:
            raise InvalidArgument("--grace-s must be >= 0")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"--metrics-port must be -1 (off) or in 0..65535 (got {self.metrics_port})")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise InvalidArgument(f"--trace-sample-ratio must be in [0, 1] (got {self.trace_sample_ratio})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise InvalidArgument(f"--{name.replace('_', '-')} {path!r} is not a readable file")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)


@dataclass(frozen=True)
class ModelServiceBase(ServiceBase):
    cache_dir: str = _opt("", "model cache folder (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    device: str = _opt("cpu", "torch device (cpu, cuda, cuda:0, ...)")
    max_sessions: int = _opt(256, "sessions held at once; more get RESOURCE_EXHAUSTED")
    idle_timeout_s: float = _opt(600.0, "sessions unused this long are dropped")
    max_kv_bytes: int = _opt(0, "KV-cache bytes all sessions may hold (0: no limit)")
    max_batch: int = _opt(32, "sessions whose steps share one forward pass (1: no batching)")
    batch_wait_ms: float = _opt(3.0, "a batch smaller than the sessions held waits up to this long for their steps")

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
        if self.batch_wait_ms < 0:
            raise InvalidArgument(f"--batch-wait-ms must be >= 0 (got {self.batch_wait_ms})")
        if self.max_batch < 1:
            raise InvalidArgument(f"--max-batch must be >= 1 (got {self.max_batch}); 1 turns batching off")


@dataclass(frozen=True)
class DraftConfig(ModelServiceBase):
    model: str = _opt(DEMO, "draft model: an HF folder, 'demo' (the demo draft) or 'ngram'")
    target_model: str = _opt(DEMO, "the target's model folder ('demo'): used to build the demo draft")
    wire_top_k: int = _opt(8, "tokens of q sent per draft position (sparse proposal)")
    wire_bits: int = _opt(16, "q is rounded to multiples of 2**-wire_bits before sampling")
    max_draft_tokens: int = _opt(32, "largest K a propose may ask for")
    ngram_cap_at_match: bool = _opt(
        True,
        "n-gram drafter: propose at most as many tokens as the context its "
        "match agrees on (--no-ngram-cap-at-match: always K when there are K)",
    )

    def validate(self) -> None:
        super().validate()
        if self.wire_top_k < 1:
            raise InvalidArgument(f"--wire-top-k must be >= 1 (got {self.wire_top_k})")
        if not 1 <= self.wire_bits <= 24:
            raise InvalidArgument(f"--wire-bits must be in 1..24 (got {self.wire_bits})")
        if self.max_draft_tokens < 1:
            raise InvalidArgument("--max-draft-tokens must be >= 1")


@dataclass(frozen=True)
class TargetConfig(ModelServiceBase):
    model: str = _opt(DEMO, "target model: an HF folder or 'demo' (SmolLM2-135M-Instruct)")
    tp: int = _opt(1, "tensor-parallel workers (ranks); each holds 1/tp of the sharded weights")
    executor: str = _opt("mp", "how tp > 1 workers run: local processes or Ray actors", choices=["mp", "ray"])
    ray_address: str = _opt("", "Ray cluster to join (empty: start a local Ray)")
    worker_ready_timeout_s: float = _opt(300.0, "how long to wait for all tp workers to load")
    exit_on_worker_failure: bool = _opt(
        False, "exit (for Kubernetes to restart) instead of restarting the worker group"
    )

    def validate(self) -> None:
        super().validate()
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
    tokenizer: str = _opt(DEMO, "tokenizer folder (the target's model folder) or 'demo'")
    cache_dir: str = _opt("", "model cache folder (for the demo tokenizer)")
    draft_length: int = _opt(4, "draft tokens per round when speculation is fixed or automatic")
    max_draft_length: int = _opt(16, "largest draft length a request may ask for")
    speculation: str = _opt("auto", "default speculation mode", choices=["auto", "fixed", "off"])
    pipeline: str = _opt(
        "off",
        "default pipelining: draft the next round during verification",
        choices=["off", "bonus-match", "post-verify"],
    )
    default_max_new_tokens: int = _opt(128, "max_new_tokens when a request sets none")
    max_new_tokens_limit: int = _opt(4096, "largest max_new_tokens a request may ask for")
    max_concurrent_requests: int = _opt(64, "requests served at once; more get RESOURCE_EXHAUSTED")
    max_stop_strings: int = _opt(16, "stop strings a request may give")
    max_prompt_chars: int = _opt(1_000_000, "longest prompt text accepted")
    draft_timeout_s: float = _opt(5.0, "a draft answer later than this falls back to target-only")
    target_timeout_s: float = _opt(30.0, "a target answer later than this fails the round")
    request_timeout_s: float = _opt(300.0, "deadline for requests that carry none")
    draft_retry_s: float = _opt(2.0, "after a draft failure, speculate again after this long")
    api_token_file: str = _opt("", "file holding the bearer token clients must send (empty: no token)")
    peer_tls_ca: str = _opt("", "CA bundle (PEM) to verify draft and target certificates (turns TLS on to peers)")
    peer_tls_cert: str = _opt("", "client certificate (PEM) for mutual TLS to draft and target")
    peer_tls_key: str = _opt("", "client private key (PEM) for mutual TLS to draft and target")
    peer_tls_server_name: str = _opt("", "name to verify in peer certificates (default: the address host)")

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
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise InvalidArgument("need 1 <= --default-max-new-tokens <= --max-new-tokens-limit")
        for name in ("max_concurrent_requests", "max_stop_strings", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")
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
        for name in ("api_token_file", "peer_tls_ca", "peer_tls_cert", "peer_tls_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise InvalidArgument(f"--{name.replace('_', '-')} {path!r} is not a readable file")


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _env_default(name: str, kind: Any, default: Any, choices: Sequence[str] | None = None) -> Any:
    raw = os.environ.get(f"SPECD_{name.upper()}")
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError as exc:
        raise InvalidArgument(
            f"SPECD_{name.upper()}={raw!r} is not a valid {getattr(kind, '__name__', 'value')}"
        ) from exc
    if choices is not None and value not in choices:
        raise InvalidArgument(f"SPECD_{name.upper()}={raw!r} must be one of {', '.join(choices)}")
    return value


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per dataclass field, defaulting to SPECD_<FIELD> or the field default."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(
                f"--{f.name.replace('_', '-')}",
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=_env_default(f.name, _parse_bool, f.default),
                help=f"{f.metadata.get('help', '')} (default: %(default)s)",
            )
            continue
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            type=kind,
            default=_env_default(f.name, kind, f.default, f.metadata.get("choices")),
            choices=f.metadata.get("choices"),
            help=f"{f.metadata.get('help', '')} (default: %(default)s)",
        )


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    config = cls(**values)
    config.validate()  # type: ignore[attr-defined]
    return config
