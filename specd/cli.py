"""The `specd` command: up | serve | generate | prepare."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from specd import config as cfg
from specd.errors import SpecdError


def _serve(args: argparse.Namespace) -> int:
    service = args.service
    kind = {"draft": cfg.DraftConfig, "target": cfg.TargetConfig, "coordinator": cfg.CoordinatorConfig}[service]
    config = cfg.from_args(kind, args)
    logging.basicConfig(level=config.log_level, format=f"%(asctime)s specd-{service} %(levelname)s %(name)s: %(message)s")
    from specd.serving import serve_until_signal

    async def main() -> None:
        if service == "draft":
            from draft_service.server import create_server as create_draft

            handle = create_draft(config)  # type: ignore[arg-type]
        elif service == "target":
            from target_service.server import create_server as create_target

            handle = create_target(config)  # type: ignore[arg-type]
        else:
            from coordinator.server import create_server as create_coordinator

            handle, _ = await create_coordinator(config)  # type: ignore[arg-type]
        await handle.server.start()
        await serve_until_signal(handle, config.grace_s, f"specd-{service} listening on {config.host}:{handle.port}")

    asyncio.run(main())
    return 0


def _up(args: argparse.Namespace) -> int:
    from specd.launcher import run_up

    return run_up(
        target=args.target,
        draft=args.draft,
        host=args.host,
        port=args.port,
        cache_dir=args.cache_dir,
        draft_length=args.draft_length,
        target_threads=args.target_threads,
        draft_threads=args.draft_threads,
    )


def _generate(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from coordinator.client import CoordinatorClient

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
        ignore_eos=args.ignore_eos,
    )
    prompt: object = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    token = None
    if args.token_file:
        from specd.security import read_token

        token = read_token(args.token_file)
    with CoordinatorClient(args.address, timeout=args.timeout, tls_ca=args.tls_ca or None, token=token) as client:
        if args.stream and not args.json:
            for msg in client.generate_stream(prompt, **kwargs):  # type: ignore[arg-type]
                sys.stdout.write(msg.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        response = client.generate(prompt, **kwargs)  # type: ignore[arg-type]
    if args.json:
        stats = MessageToDict(response.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        finish = response.DESCRIPTOR.fields_by_name["finish_reason"].enum_type.values_by_number[response.finish_reason].name
        out = {
            "text": response.text,
            "token_ids": list(response.token_ids),
            "finish_reason": finish.removeprefix("FINISH_REASON_").lower(),
            "stats": stats,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(response.text)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from specd import catalog

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = cfg.default_cache_dir() if not args.cache_dir else __import__("pathlib").Path(args.cache_dir)
    print(f"demo target: {catalog.target_folder(cfg.DEMO, cache)}")
    print(f"demo draft:  {catalog.demo_draft_path(cache)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Distributed speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start draft, target and coordinator locally (demo pair by default)")
    up.add_argument("--target", default=cfg.DEMO, help="target model folder or 'demo' (default: demo)")
    up.add_argument("--draft", default=cfg.DEMO, help="draft model folder, 'demo', 'ngram' or 'none' (default: demo)")
    up.add_argument("--host", default="127.0.0.1", help="coordinator address (default: 127.0.0.1)")
    up.add_argument("--port", type=int, default=50051, help="coordinator port (default: 50051)")
    up.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    up.add_argument("--draft-length", type=int, default=4, help="draft tokens per round (default: 4)")
    up.add_argument("--target-threads", type=int, default=2, help="torch threads of the target (default: 2)")
    up.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft (default: 1)")
    up.set_defaults(func=_up)

    serve = sub.add_parser("serve", help="run one service (what a container runs)")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name, kind in (("draft", cfg.DraftConfig), ("target", cfg.TargetConfig), ("coordinator", cfg.CoordinatorConfig)):
        p = serve_sub.add_parser(name, help=f"the {name} service")
        cfg.add_arguments(p, kind)
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
    gen.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds (default: 300)")
    gen.add_argument("--tls-ca", default="", help="CA bundle (PEM) to verify the coordinator (turns TLS on)")
    gen.add_argument("--token-file", default="", help="file holding the API token")
    gen.set_defaults(func=_generate)

    prep = sub.add_parser("prepare", help="build the demo models into the cache (setup does this once)")
    prep.add_argument("--cache-dir", default="")
    prep.set_defaults(func=_prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecdError as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
