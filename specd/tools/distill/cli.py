"""The command lines: `specd distill` (train) and `python -m specd.tools.distill evaluate`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from specd.core.model.catalog import draft_folder, target_folder
from specd.serving import config as cfg
from specd.tools.distill.config import SOURCES, DistillConfig
from specd.tools.distill.evaluate import evaluate
from specd.tools.distill.prompts import read_prompt_set
from specd.tools.distill.train import run_distill


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DistillConfig(target=Path("."), out=Path("."))
    p.add_argument("--target", default="demo", help="target model folder, or 'demo' (default: demo)")
    p.add_argument("--out", required=True, help="folder for the trained draft (an HF folder, plus compact/)")
    p.add_argument("--work-dir", default="", help="data and checkpoints (default: OUT/work)")
    p.add_argument("--cache-dir", default="", help="model cache for --target demo")
    p.add_argument("--layers", type=int, default=d.layers, help=f"draft layers (default: {d.layers})")
    p.add_argument(
        "--init",
        choices=["target", "random"],
        default=d.init,
        help="start from the target's first layers or from random weights (default: target)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=d.vocab,
        help=f"reduced head: the N most used tokens (0: full vocabulary; default: {d.vocab})",
    )
    p.add_argument("--train-head", action="store_true", help="train the head rows too (they are then shipped)")
    p.add_argument(
        "--source",
        action="append",
        dest="sources",
        help=f"data: one of {', '.join(SOURCES)}, prompts:FILE (the target's answers to "
        "more prompts), or a text file/folder (repeatable; default: generations, stdlib, shakespeare)",
    )
    p.add_argument(
        "--prompts", default=d.prompts, help="prompts for generations: 'builtin' or a file (default: builtin)"
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="new tokens per prompt")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--gen-temperature", type=float, default=d.gen_temperature, help="0: greedy continuations")
    p.add_argument(
        "--gen-minutes",
        type=float,
        default=d.gen_minutes,
        help="time limit for generating (0: none); a rerun continues the remaining prompts",
    )
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts as plain text, not chat")
    p.add_argument(
        "--num-continuations",
        type=int,
        default=d.num_continuations,
        help="plain-text openings (prose, code) for the continuations source",
    )
    p.add_argument("--corpus-tokens", type=int, default=d.corpus_tokens, help="tokens per text corpus")
    p.add_argument("--teacher-top-k", type=int, default=d.teacher_top_k)
    p.add_argument("--teacher-dtype", choices=["float32", "bfloat16"], default=d.teacher_dtype)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (at most, with --train-minutes)")
    p.add_argument(
        "--train-minutes",
        type=float,
        default=d.train_minutes,
        help="train for this long (the schedule follows time; --steps caps it; 0: steps only)",
    )
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--autocast", choices=["auto", "on", "off"], default=d.autocast, help="bfloat16 autocast")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="sequences held out to measure KL and top-1 agreement (default: %(default)s)",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--resume", action="store_true", help="continue from the work folder's checkpoint")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    cache = Path(args.cache_dir) if args.cache_dir else cfg.default_cache_dir()
    names = {f.name for f in dataclasses.fields(DistillConfig)}
    kwargs = {k: v for k, v in vars(args).items() if k in names and v is not None}
    kwargs["target"] = target_folder(args.target, cache)
    kwargs["out"] = Path(args.out)
    kwargs["work_dir"] = Path(args.work_dir) if args.work_dir else None
    return DistillConfig(**kwargs)


def main_distill(args: argparse.Namespace) -> int:
    """`specd distill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_distill(config_from_args(args))
    final = summary["final"]
    print(
        json.dumps(
            {
                "out": str(args.out),
                "steps": summary["steps"],
                "initial": summary["initial"],
                "final": final,
                "wall_seconds": round(float(summary["wall_seconds"]), 1),  # type: ignore[arg-type]  # a float
            }
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """python -m specd.tools.distill evaluate|assemble ..."""
    parser = argparse.ArgumentParser(prog="python -m specd.tools.distill")
    sub = parser.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="acceptance, c and in-process speed-up of a draft on prompts")
    ev.add_argument("--target", default="demo")
    ev.add_argument("--draft", default="demo", help="draft folder, 'demo' or 'ngram'")
    ev.add_argument(
        "--prompts",
        required=True,
        help="JSONL with prompt/format (specd bench's set), JSON list / {'prompts': [...]}, or one a line",
    )
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--draft-length", type=int, default=4)
    ev.add_argument("--threads", type=int, default=1)
    ev.add_argument("--no-chat", dest="chat", action="store_false")
    ev.add_argument("--no-baseline", dest="baseline", action="store_false")
    ev.add_argument("--limit", type=int, default=0, help="first N prompts only")
    ev.add_argument("--json", default="", help="write the full result here")
    ev.add_argument("--cache-dir", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = Path(args.cache_dir) if args.cache_dir else cfg.default_cache_dir()
    target = target_folder(args.target, cache)
    draft = args.draft if args.draft == "ngram" else draft_folder(args.draft, args.target, cache)
    prompts = read_prompt_set(args.prompts, args.chat)
    if args.limit:
        prompts = prompts[: args.limit]
    result = evaluate(
        target,
        draft,
        prompts,
        max_new_tokens=args.max_new_tokens,
        draft_length=args.draft_length,
        chat=args.chat,
        threads=args.threads,
        baseline=args.baseline,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=1))
    return 0
