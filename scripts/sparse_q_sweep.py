#!/usr/bin/env python3
"""Sweep the sparse q by mass: acceptance, wire bytes and build time against epsilon, budget and grid.

For each temperature and top-p, the target samples trajectories (target-only,
the request's settings) from a few prompts; at every position of them we keep
the target's processed p and each draft's processed q (the draft reads the same
tokens). For every q setting the real builder (specd.core.sampling.sparse_q) turns q into
what the draft would send, and per position we record

- acceptance: sum_x min(p(x), q_sent(x)), the exact probability that the draft
  token drawn from q_sent is accepted (no sampling noise);
- the K = 4 acceptance rate (accepted / draft tokens) that rounds starting at each
  position would reach, E[sum_i prod_{j<=i} a_j] / 4 over the next 4 positions
  (an estimate: it reads the trajectory's own tokens where a round would read the
  draft's);
- wire bytes of that position's q, as the draft service encodes it;
- the time to build q and sample from it for one row (as a draft step for one
  session does);
- for comparison, the time of the old drafter step (a full sort, top-8);
- the acceptance a *uniform tail bucket* would add (the rest of the mass spread
  evenly over the unlisted tokens; not implemented, measured to decide).

    PYTHONPATH=$PWD python scripts/sparse_q_sweep.py --drafts self,demo \
        --json bench-results/sparse-q.json --markdown bench-results/sparse-q.md

Acceptance and bytes do not depend on machine load; the times do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from measure_args import floats, ints, names

from specd.core.model import catalog
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling import sparse_q
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import Role, SamplingParams, coins, draft_token, processed_probs, sample_from_probs
from specd.core.sampling.sparse_q import QSettings
from specd.serving.config import default_cache_dir
from specd.serving.wire import proposal_to_proto, q_wire_bytes

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "Explain how a rainbow forms in the sky.",
    "Here is a list of five fruits:\n1.",
    "def quicksort(xs):",
]


@dataclass
class Distributions:
    """Per position of the sampled trajectories: the target's p and each draft's q, [N, V] each."""

    p: torch.Tensor
    q: dict[str, torch.Tensor]
    trajectory_length: int


def _probs(runner: CausalLMRunner, tokens: list[int], n_last: int, params: SamplingParams) -> torch.Tensor:
    s = runner.new_session(tokens)
    logits = runner.logits(s, n_last)  # [n_last, V]
    return processed_probs(logits[None], [params])[0]


@torch.inference_mode()
def distributions(
    target: CausalLMRunner,
    drafts: dict[str, CausalLMRunner],
    prompts: list[list[int]],
    params: SamplingParams,
    seeds: int,
    tokens: int,
) -> Distributions:
    ps, qs = [], {name: [] for name in drafts}
    for pi, prompt in enumerate(prompts):
        for seed in range(seeds):
            s = target.new_session(prompt)
            for _ in range(tokens):  # target-only sampling, the bonus coin of (seed, position)
                p = processed_probs(target.logits(s, 1)[-1:][None], [params])[0, 0]
                u = coins(torch.tensor([1000 * pi + seed]), torch.tensor([[len(s.tokens)]]), Role.BONUS)[0]
                target.append(s, [int(sample_from_probs(p[None].double(), u)[0])])
            seq = list(s.tokens)
            ps.append(_probs(target, seq[:-1], tokens, params))  # p at each of the sampled positions
            for name, runner in drafts.items():
                qs[name].append(_probs(runner, seq[:-1], tokens, params))
    return Distributions(torch.cat(ps), {n: torch.cat(v) for n, v in qs.items()}, tokens)


def rate_k(a: torch.Tensor, length: int, k: int = 4) -> float:
    """Mean over round starts of E[accepted] / k, rounds of k positions inside each trajectory."""
    a = a.view(-1, length)
    starts = length - k + 1
    windows = torch.stack([a[:, j : j + k] for j in range(starts)], 1)  # [T, starts, k]
    return float((windows.cumprod(-1).sum(-1) / k).mean())


def measure(d: Distributions, draft: str, settings: QSettings, time_rows: int) -> dict:
    p, q = d.p.double(), d.q[draft]
    ids, w = sparse_q.build(q, settings)  # [N, W]
    sent = torch.zeros_like(p).scatter_add_(-1, ids, w.double())  # weights at their ids (padding adds 0 to id 0)
    sent = sent / sent.sum(-1, keepdim=True)
    a = torch.minimum(p, sent).sum(-1)  # [N]
    # a uniform tail bucket: the untruncated rest spread evenly over the tokens not listed
    listed = sent > 0
    rest = 1.0 - (q.double() * listed).sum(-1, keepdim=True)  # the draft's own mass left out
    tail = torch.where(listed, sent * (1 - rest), rest / (~listed).sum(-1, keepdim=True))
    a_tail = torch.minimum(p, tail).sum(-1)
    nbytes = []
    for n in range(q.shape[0]):
        msg = proposal_to_proto(Proposal([int(ids[n, 0])], ids[n : n + 1], w[n : n + 1]))
        nbytes.append(q_wire_bytes(msg)[0])
    times = []
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(q.shape[0], generator=g)[:time_rows]
    for n in rows.tolist():
        t0 = time.perf_counter()
        sparse_q.draft(q[n : n + 1], settings, torch.tensor([0]), torch.tensor([n]))
        times.append((time.perf_counter() - t0) * 1e3)
    b = torch.tensor(nbytes, dtype=torch.float64)
    return {
        "draft": draft,
        "epsilon": settings.epsilon,
        "max_tokens": settings.max_tokens,
        "bits": settings.bits,
        "positions": int(q.shape[0]),
        "acceptance": float(a.mean()),
        "acceptance_rate_k4": rate_k(a, d.trajectory_length),
        "acceptance_with_tail": float(a_tail.mean()),
        "acceptance_rate_k4_with_tail": rate_k(a_tail, d.trajectory_length),
        "tokens_p50": float((w > 0).sum(-1).double().median()),
        "tokens_max": int((w > 0).sum(-1).max()),
        "bytes_p50": float(b.quantile(0.5)),
        "bytes_p99": float(b.quantile(0.99)),
        "bytes_max": int(b.max()),
        "build_ms_p50": statistics.median(times),
    }


def legacy_build_ms(q: torch.Tensor, time_rows: int) -> float:
    """Per row, the old drafter step (specd.core.sampling.sampler.draft_token, a full sort, top-8): median ms."""
    times = []
    for n in torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(0))[:time_rows].tolist():
        t0 = time.perf_counter()
        draft_token(q[n : n + 1], 8, 16, torch.tensor([0]), torch.tensor([n]))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="demo", help="target model folder or 'demo'")
    ap.add_argument("--drafts", default="self,demo", help="comma list: self (the target), demo, or folders")
    ap.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--top-ps", default="1.0,0.9")
    ap.add_argument("--epsilons", default="0.01,0.001,0.0001")
    ap.add_argument("--budgets", default="256,512,1024,1536,2048,4096")
    ap.add_argument("--bits", default="20", help="wire grids, comma list")
    ap.add_argument("--top-k", default="8,64,512", help="legacy fixed top-k rows (epsilon 0, grid 2**-16)")
    ap.add_argument("--seeds", type=int, default=2, help="trajectories per prompt")
    ap.add_argument("--tokens", type=int, default=24, help="positions per trajectory")
    ap.add_argument("--time-rows", type=int, default=24, help="positions whose build is timed per setting")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", default="", help="write all records here")
    ap.add_argument("--markdown", default="", help="write a table here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    target_dir = catalog.target_folder(args.target, cache)
    loaded_target, target = catalog.load_for_serving(target_dir, "cpu")
    drafts: dict[str, CausalLMRunner] = {}
    for name in names(args.drafts):
        if name == "self":
            drafts[name] = target
        else:
            _, runner, token_map = catalog.load_draft_for_serving(
                catalog.draft_folder(name, str(target_dir), cache), "cpu"
            )
            if token_map is not None:
                sys.exit(f"draft {name}: a reduced head is not supported by this sweep")
            drafts[name] = runner
    prompts = [loaded_target.tokenizer(t, add_special_tokens=False).input_ids for t in PROMPTS]
    settings = [
        QSettings(e, m, b) for b, e, m in itertools.product(ints(args.bits), floats(args.epsilons), ints(args.budgets))
    ] + [QSettings.top_k(k, 16) for k in ints(args.top_k)]
    records = []
    for temperature, top_p in itertools.product(floats(args.temperatures), floats(args.top_ps)):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        t0 = time.perf_counter()
        d = distributions(target, drafts, prompts, params, args.seeds, args.tokens)
        print(f"T={temperature} top_p={top_p}: {d.p.shape[0]} positions ({time.perf_counter() - t0:.0f} s)", flush=True)
        legacy = legacy_build_ms(d.q[next(iter(drafts))], args.time_rows)
        print(f"  old drafter step (sampling.draft_token, top-8, full sort): {legacy:.2f} ms per row", flush=True)
        records.append({"temperature": temperature, "top_p": top_p, "legacy_top8_build_ms_p50": legacy})
        for name in drafts:
            for s in settings:
                r = {"temperature": temperature, "top_p": top_p, **measure(d, name, s, args.time_rows)}
                records.append(r)
                print(
                    f"  {name:5s} eps {s.epsilon:<7g} budget {s.max_tokens:5d} bits {s.bits}: "
                    f"a {r['acceptance']:.4f} rate4 {r['acceptance_rate_k4']:.4f} "
                    f"(+tail {r['acceptance_rate_k4_with_tail']:.4f}) "
                    f"bytes p50 {r['bytes_p50']:.0f} p99 {r['bytes_p99']:.0f} build {r['build_ms_p50']:.2f} ms",
                    flush=True,
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(records))


def markdown(records: list[dict]) -> str:
    head = (
        "| draft | T | top-p | epsilon | budget | bits | acceptance | rate K=4 | rate K=4 + tail | "
        "tokens p50 | bytes p50 | bytes p99 | build ms p50 |\n" + "|---" * 13 + "|\n"
    )
    records = [r for r in records if "draft" in r]
    rows = [
        f"| {r['draft']} | {r['temperature']} | {r['top_p']} | {r['epsilon']:g} | {r['max_tokens']} | {r['bits']} | "
        f"{r['acceptance']:.4f} | {r['acceptance_rate_k4']:.4f} | {r['acceptance_rate_k4_with_tail']:.4f} | "
        f"{r['tokens_p50']:.0f} | {r['bytes_p50']:.0f} | {r['bytes_p99']:.0f} | {r['build_ms_p50']:.2f} |"
        for r in records
    ]
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
