"""The `specd` command: up | serve | generate | bench | prepare."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.json_format import MessageToDict

from coordinator.client import CoordinatorClient, Prompt
from coordinator.http_server import OpenAIServer
from coordinator.server import create_service as create_coordinator
from draft_service.server import create_server as create_draft
from specd.core.errors import InvalidArgument, SpecdError
from specd.core.model import catalog
from specd.serving import config as cfg
from specd.serving import flags
from specd.serving.cpu_budget import cpu_budget, service_threads
from specd.serving.cpu_threads import describe_threads
from specd.serving.host_memory import keep_freed_buffers
from specd.serving.metrics import CoordinatorMetrics, DraftMetrics, TargetMetrics
from specd.serving.metrics_http import serve_metrics
from specd.serving.security import read_token
from specd.serving.server import run_event_loop, serve_until_signal
from specd.serving.tracing import setup_tracing
from specd.tools import distill
from specd.tools.bench import add_arguments as add_bench_arguments
from specd.tools.bench.main import run as run_bench
from specd.tools.client_errors import CallContext, explain
from specd.tools.launcher import run_up
from target_service.server import create_server as create_target

log = logging.getLogger("specd")


def _serve(args: argparse.Namespace) -> int:
    service = args.service
    kind: type[cfg.ServiceBase] = {
        "draft": cfg.DraftConfig,
        "target": cfg.TargetConfig,
        "coordinator": cfg.CoordinatorConfig,
    }[service]
    config = flags.from_args(kind, args)
    logging.basicConfig(
        level=config.log_level, format=f"%(asctime)s specd-{service} %(levelname)s %(name)s: %(message)s"
    )
    _set_threads(config)
    sys.setswitchinterval(config.gil_switch_ms / 1e3)
    keep_freed_buffers(config.malloc_keep_mib)

    async def main() -> None:
        tracing = setup_tracing(service, config)  # a no-op unless an OTLP endpoint is configured
        metrics_on = config.metrics_port >= 0
        metrics: CoordinatorMetrics | DraftMetrics | TargetMetrics | None
        openai: OpenAIServer | None = None
        if isinstance(config, cfg.DraftConfig):
            metrics = draft_metrics = DraftMetrics() if metrics_on else None
            handle = create_draft(config, tracing=tracing, metrics=draft_metrics)
        elif isinstance(config, cfg.TargetConfig):
            metrics = target_metrics = TargetMetrics() if metrics_on else None
            handle = create_target(config, tracing=tracing, metrics=target_metrics)
        else:
            assert isinstance(config, cfg.CoordinatorConfig)
            metrics = coordinator_metrics = CoordinatorMetrics() if metrics_on else None
            coordinator = await create_coordinator(config, tracing=tracing, metrics=coordinator_metrics)
            handle, openai = coordinator.handle, coordinator.openai
        metrics_server = None
        if metrics is not None:
            metrics_server, metrics_port = serve_metrics(metrics.registry, config.host, config.metrics_port)
            print(f"specd-{service} metrics on {config.host}:{metrics_port}", flush=True)
        await handle.server.start()
        try:
            if openai is not None:  # before the banner: `specd up` and the tests read this line first
                http_port = await openai.start()
                print(f"specd-{service} openai on {config.host}:{http_port} ({openai.scheme})", flush=True)
            await serve_until_signal(
                handle, config.grace_s, f"specd-{service} listening on {config.host}:{handle.port}"
            )
        finally:
            if openai is not None:
                await openai.stop()  # already stopped by a graceful shutdown; at once otherwise
            if metrics_server is not None:
                metrics_server.shutdown()
            tracing.shutdown(timeout_s=3.0)  # bounded: a dead collector must not hold up exit

    run_event_loop(main(), config.event_loop)
    # Stopped cleanly: the server drained, tracing flushed, the metrics server down, the model's
    # workers stopped (the handle's on_stop). Skip the interpreter's teardown of torch and
    # transformers, which costs about a second of CPU per process and frees nothing the OS does not.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _set_threads(config: cfg.ServiceBase) -> None:
    """Apply the service's intra-op threads before it builds anything (--torch-threads 0: from the CPUs available).

    torch's own default is one thread per core of the machine, which is too
    many in a container with a CPU limit or beside other work. With 0 a CPU
    model service also runs each forward pass with only the CPUs that other
    processes leave free (specd.serving.cpu_threads). Inter-op parallelism is
    not used by the services: one thread.
    """
    ranks = getattr(config, "tp", 1)
    torch.set_num_threads(service_threads(config.torch_threads, ranks))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    log.info(
        "threads: %s; %d inter-op (CPUs available: %d)",
        describe_threads(torch.get_num_threads()),
        torch.get_num_interop_threads(),
        cpu_budget(),
    )


def _up(args: argparse.Namespace) -> int:
    return run_up(
        target=args.target,
        draft=args.draft,
        host=args.host,
        port=args.port,
        cache_dir=args.cache_dir,
        draft_length=args.draft_length,
        target_threads=args.target_threads,
        draft_threads=args.draft_threads,
        target_args=_tp_args(args),
        restart=not args.no_restart,
        target_replicas=_replicas(args.target_replicas, "--target-replicas"),
        draft_replicas=_replicas(args.draft_replicas, "--draft-replicas"),
        http_port=args.http_port,
    )


def _replicas(n: int, flag: str) -> int:
    if n < 1:
        raise InvalidArgument(f"{flag} must be >= 1 (got {n})")
    return n


def _tp_args(args: argparse.Namespace) -> list[str]:
    """`specd serve target` flags for the tensor-parallel settings of `specd up`."""
    if args.tp < 1:
        raise InvalidArgument(f"--tp must be >= 1 (got {args.tp})")
    out = ["--tp", str(args.tp), "--executor", args.executor]
    if args.ray_address:
        out += ["--ray-address", args.ray_address]
    return out


def _generate(args: argparse.Namespace) -> int:
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop or (),
        speculation="off" if args.no_speculation else ("fixed" if args.draft_length else None),
        draft_length=args.draft_length or 0,
        pipeline=args.pipeline,
        ignore_eos=args.ignore_eos,
        cache_salt=args.cache_salt,
        tree_budget=args.tree_budget,
    )
    # trees run fixed, depth = draft length; --pipeline bonus-match pipelines them (docs/trees.md)
    if args.tree_budget and not args.no_speculation:
        kwargs.update(speculation="fixed", draft_length=args.draft_length or 4, pipeline=args.pipeline or "off")
    prompt: Prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    token = None
    if args.token_file:
        token = read_token(args.token_file)
    ctx = CallContext(address=args.address, tls=bool(args.tls_ca), token=token is not None, timeout_s=args.timeout)
    started = time.monotonic()
    try:
        with CoordinatorClient(args.address, timeout=args.timeout, tls_ca=args.tls_ca or None, token=token) as client:
            if args.stream and not args.json:
                final = None
                for msg in client.generate_stream(prompt, **kwargs):
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                    if msg.HasField("stats"):
                        final = msg.stats
                sys.stdout.write("\n")
                if final is not None:
                    print(_speculation_line(final), file=sys.stderr)
                return 0
            response = client.generate(prompt, **kwargs)
    except grpc.RpcError as exc:
        code, line = explain(exc, ctx, time.monotonic() - started)
        if args.verbose:
            traceback.print_exc()
        print(f"specd: {line}", file=sys.stderr)
        return code
    if args.json:
        stats = MessageToDict(
            response.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        stats["seed"] = int(stats.get("seed", 0))  # uint64 comes out of protobuf's JSON as a string
        finish_reasons = response.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
        assert finish_reasons is not None  # an enum field
        finish = finish_reasons.values_by_number[response.finish_reason].name
        out = {
            "text": response.text,
            "token_ids": list(response.token_ids),
            "finish_reason": finish.removeprefix("FINISH_REASON_").lower(),
            "stats": stats,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(response.text)
        print(_speculation_line(response.stats), file=sys.stderr)
    return 0


def _speculation_line(stats: object) -> str:
    """What speculation did for this request (on stderr, so stdout stays the text)."""
    s: Any = stats
    if not s.draft_tokens:
        return f"[{s.completion_tokens} tokens, {s.tokens_per_s:.1f} tokens/s; no draft tokens verified]"
    return (
        f"[acceptance {s.acceptance_rate:.2f} ({s.accepted_tokens} of {s.draft_tokens} draft tokens), "
        f"{s.completion_tokens / max(1, s.rounds):.2f} tokens per round, {s.tokens_per_s:.1f} tokens/s]"
    )


def _prepare(args: argparse.Namespace) -> int:
    """One line per step (a progress bar while the demo target converts)."""
    logging.basicConfig(level=logging.INFO, format="specd prepare: %(message)s")
    cache = Path(args.cache_dir) if args.cache_dir else cfg.default_cache_dir()
    started = time.monotonic()
    print(f"demo target: {catalog.target_folder(catalog.DEMO, cache)} ({time.monotonic() - started:.1f} s)", flush=True)
    started = time.monotonic()
    print(f"demo draft:  {catalog.demo_draft_path(cache)} ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


def _distill(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(
        prog="specd distill", description="Train a draft model for a target (KL to its distributions)."
    )
    distill.add_arguments(parser)
    return distill.main_distill(parser.parse_args(args.distill_args))


def _bench(args: argparse.Namespace) -> int:
    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd",
        description="Distributed speculative decoding.",
        epilog="Exit codes: 0 ok, 1 other error, 2 bad usage or argument, 3 coordinator unreachable, "
        "4 TLS mismatch, 5 API token refused, 6 deadline exceeded, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start draft, target and coordinator locally (demo pair by default)")
    up.add_argument("--target", default=catalog.DEMO, help="target model folder or 'demo' (default: demo)")
    up.add_argument(
        "--draft",
        default=catalog.default_up_draft(),
        help="draft model folder, 'demo', 'ngram', 'suffix', 'suffix+MODEL' or 'none' (default: 'suffix' until a "
        "trained demo draft ships, then 'demo'; suffix falls back to n-gram lookup when it has nothing)",
    )
    up.add_argument("--host", default="127.0.0.1", help="coordinator address (default: 127.0.0.1)")
    up.add_argument("--port", type=int, default=50051, help="coordinator port (default: 50051)")
    up.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the coordinator's OpenAI-compatible HTTP API port on --host (default: 8000; 0 a free one, -1 off)",
    )
    up.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    up.add_argument("--draft-length", type=int, default=4, help="draft tokens per round (default: 4)")
    up.add_argument(
        "--target-threads",
        type=int,
        default=0,
        help="torch threads of the target (default 0: one per CPU available to it)",
    )
    up.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft (default: 1)")
    up.add_argument(
        "--no-restart",
        action="store_true",
        help="stop everything when a service exits (default: restart it with backoff; the others keep serving)",
    )
    up.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the target (default: 1)")
    up.add_argument(
        "--target-replicas",
        type=int,
        default=1,
        help="target replicas (each a --tp group) behind the coordinator, which spreads sessions over them (default: 1)",
    )
    up.add_argument("--draft-replicas", type=int, default=1, help="draft replicas (default: 1)")
    up.add_argument(
        "--executor",
        choices=["mp", "ray"],
        default="mp",
        help="how the target's tp ranks run: local processes or Ray actors (default: mp)",
    )
    up.add_argument("--ray-address", default="", help="Ray cluster for --executor ray (default: start a local Ray)")
    up.set_defaults(func=_up)

    serve = sub.add_parser("serve", help="run one service (what a container runs)")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name, kind in (
        ("draft", cfg.DraftConfig),
        ("target", cfg.TargetConfig),
        ("coordinator", cfg.CoordinatorConfig),
    ):
        p = serve_sub.add_parser(name, help=f"the {name} service")
        flags.add_arguments(p, kind)
        p.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="call Generate on a running coordinator")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--address", default="127.0.0.1:50051", help="coordinator HOST:PORT (default: 127.0.0.1:50051)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--draft-length", type=int, default=None, help="fixed draft length K (default: server's choice)")
    gen.add_argument(
        "--tree-budget",
        type=int,
        default=0,
        help="tree speculation: trees of at most N nodes, --draft-length levels deep (default 4; docs/trees.md); "
        "pipelined with --pipeline bonus-match",
    )
    gen.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    gen.add_argument(
        "--pipeline",
        choices=["off", "bonus-match", "post-verify", "spec-cache", "auto"],
        default=None,
        help="draft the next round while this one is verified (default: server's choice)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.add_argument(
        "--cache-salt",
        default="",
        help="narrows your tenant: a suffix draft proposes what it learned only to requests with the same "
        "identity and salt (with no mTLS or token, the salt alone; keep it secret)",
    )
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds (default: 300)")
    gen.add_argument("--tls-ca", default="", help="CA bundle (PEM) to verify the coordinator (turns TLS on)")
    gen.add_argument("--token-file", default="", help="file holding the API token")
    gen.add_argument("-v", "--verbose", action="store_true", help="print the traceback of an error, too")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser(
        "bench",
        help="benchmark decoding modes side by side (target-only baseline, fixed K, "
        "auto, the transformers baseline): JSON, markdown, PNG",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    prep = sub.add_parser("prepare", help="build the demo models into the cache (setup does this once)")
    prep.add_argument("--cache-dir", default="")
    prep.set_defaults(func=_prepare)

    # `specd distill` parses its own flags (specd.tools.distill.add_arguments) from
    # the rest of the command line.
    dist = sub.add_parser("distill", help="train a draft model for a target (see docs/distill.md)", add_help=False)
    dist.set_defaults(func=_distill, distill_args=[])  # main() hands it the rest of the command line
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "distill":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "distill":
        args.distill_args = rest
    try:
        return int(args.func(args) or 0)
    except SpecdError as exc:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
