#!/usr/bin/env python3
"""Acceptance of the target as its own draft, through the three services (issue #21's setup).

Starts `specd serve target --model DIR`, `specd serve draft --model DIR
--target-model DIR [DRAFT FLAGS]` and a coordinator, then sends 16 requests
(4 prompts x 4 seeds: a story, an explanation, a list, `def quicksort(xs):`)
with fixed K = 4 and 24 new tokens at each temperature, and prints the
acceptance rate (accepted / draft tokens). With q = p every draft token should
be accepted; what falls short is what the sparse q's truncation costs.

It also reads the draft service's q metrics (where it has them): the share of
draft tokens whose q took at most 4 KiB (>= 0.99 means p99 <= 4 KiB), and the
mean bytes and build time.

    PYTHONPATH=$PWD python scripts/self_draft_acceptance.py [--draft-args "--wire-top-k 8"]

Run it with PYTHONPATH pointing at another checkout to measure that code (the
services are started with the same interpreter and environment).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import urllib.request
from pathlib import Path

from measure_args import floats
from prometheus_client.parser import text_string_to_metric_families

from specd.core.model import catalog
from specd.serving.config import default_cache_dir
from specd.tools.localcluster import LocalCluster

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "Explain how a rainbow forms in the sky.",
    "Here is a list of five fruits:\n1.",
    "def quicksort(xs):",
]
_METRICS_LINE = re.compile(r"^specd-draft metrics on (\S+):(\d+)\s*$")


def draft_q_metrics(cluster: LocalCluster) -> dict[str, float] | None:
    """The draft's q histograms, or None where the service has no such metrics (older code)."""
    assert cluster.draft is not None
    address = next((f"{m[1]}:{m[2]}" for line in cluster.draft.lines if (m := _METRICS_LINE.match(line))), None)
    if address is None:
        return None
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    got = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("specd:draft_q_"):
                got[s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else "")] = s.value
    if "specd:draft_q_bytes_count" not in got:
        return None
    n = got["specd:draft_q_bytes_count"]
    builds = got["specd:draft_q_build_seconds_count"]
    return {
        "q_draft_tokens": n,
        "q_share_le_4096_bytes": got["specd:draft_q_bytes_bucket{le=4096.0}"] / n if n else 1.0,
        "q_bytes_mean": got["specd:draft_q_bytes_sum"] / n if n else 0.0,
        "q_build_ms_mean_per_propose": 1e3 * got["specd:draft_q_build_seconds_sum"] / builds if builds else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="demo", help="target model folder or 'demo'")
    ap.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=4, help="requests per prompt")
    ap.add_argument("--draft-args", default="", help="extra flags for `specd serve draft` (one string)")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    target = catalog.target_folder(args.target, cache)
    results = []
    for temperature in floats(args.temperatures):
        # one cluster per temperature: the draft's metrics then describe that temperature only
        with (
            LocalCluster(
                target,
                target,
                target_threads=1,
                draft_threads=1,
                draft_args=["--metrics-port", "0", *shlex.split(args.draft_args)],
            ) as cluster,
            cluster.client(timeout=600) as client,
        ):
            drafted = accepted = 0
            for i, prompt in enumerate(PROMPTS):
                for seed in range(args.seeds):
                    r = client.generate(
                        prompt,
                        max_new_tokens=24,
                        temperature=temperature,
                        top_p=args.top_p,
                        seed=1000 * i + seed,
                        ignore_eos=True,
                        speculation="fixed",
                        draft_length=4,
                    )
                    drafted += r.stats.draft_tokens
                    accepted += r.stats.accepted_tokens
            row = {
                "temperature": temperature,
                "top_p": args.top_p,
                "draft_args": args.draft_args,
                "requests": len(PROMPTS) * args.seeds,
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                **(draft_q_metrics(cluster) or {}),
            }
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
