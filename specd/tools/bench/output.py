"""A run's outputs: the meta record (machine, models, settings) and the JSON, markdown and PNG files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from specd.serving.cpu_threads import openmp_settings
from specd.tools.bench.plan import Plan, learns_across_requests
from specd.tools.bench.plot import write_plot
from specd.tools.bench.report import render_markdown


def build_meta(
    args: argparse.Namespace,
    plan: Plan,
    target_dir: Path,
    draft_dir: Path | None,
    address: str,
    started: bool,
    cost: dict[str, Any],
    peak: dict[str, Any],
    correctness: dict[str, Any],
    duration_s: float,
) -> dict[str, Any]:
    categories = list(dict.fromkeys(p.category for p in plan.prompts))
    return {
        "tool": "specd bench",
        "arguments": {k: v for k, v in vars(args).items() if not callable(v)},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": duration_s,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            # what the services' torch loads and reads: the runtime, and any wait setting in the environment
            "openmp": openmp_settings(),
        },
        "models": {"target": str(target_dir), "draft": str(draft_dir) if draft_dir else args.draft},
        "address": address,
        "services_started": started,
        "settings": {
            "modes": [m.name for m in plan.modes],
            "temperatures": plan.temperatures,
            "concurrency": plan.concurrency,
            "draft_lengths": plan.draft_lengths,
            "prompts": len(plan.prompts),
            "prompt_ids": [p.id for p in plan.prompts],
            "categories": categories,
            "max_new_tokens": plan.max_new_tokens,
            "stop_at_eos": args.stop_at_eos,
            "seed": args.seed,
            "target_threads": args.target_threads,
            "draft_threads": args.draft_threads,
            "hf_threads": plan.hf_threads,
            "quick": args.quick,
            "interleave": args.interleave,
            "warm_requests": plan.warm_requests,
            "learning_draft": learns_across_requests(args.draft),  # a fresh draft service per mode, in sequence
        },
        "cost": cost,
        "peak_rss_mb": peak,
        "correctness": correctness,
    }


def write_report(report: dict[str, Any], json_path: Path, md_path: Path, png_path: Path) -> str:
    """Write the three files; returns the markdown (the run also prints it)."""
    for path in (json_path, md_path, png_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
    markdown = render_markdown(report)
    md_path.write_text(markdown, encoding="utf-8")
    emu = report["meta"].get("emulated")
    write_plot(report["records"], png_path, f"emulated: {emu['spec']}" if emu else "")
    return markdown
