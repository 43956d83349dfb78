#!/usr/bin/env python
"""Replay drafting policies on the target's own greedy answers to a prompt set, requests in sequence.

Generates the target's greedy answers once (in-process, cached in a JSON file
so that later runs and more prompts reuse them), then drives each drafter
through its real API as the draft service would, request after request:
open with the prompt, propose after each round's committed prefix, accept
the agreeing prefix plus one target token, close (a suffix drafter learns the
finished session then). Greedy output does not depend on the drafter, so the
replay gives each policy's exact rounds; time comes from a verify-cost model
T(K) = base + per_token (K + 1) ms (CPU: verifying more tokens costs more).

Reports tokens per round and modelled tokens/s over all requests and after
the first --warm requests, and the warm-up curve (speed-up over target-only
by request index, in groups).

    .venv/bin/python scripts/suffix_policy.py [--prompt-file repetitive] [--prompts 60] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.protocol import Drafter
from specd.core.draft.suffix import LearningDrafter, SuffixDrafter, SuffixSettings
from specd.core.inprocess import speculative_generate
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.tools.bench import load_prompts, select_prompts, tokenize_prompt

Answers = list[tuple[list[int], list[int]]]
GREEDY = SamplingParams(temperature=0.0)


def greedy_answers(target: str, prompt_file: str, n: int, max_new_tokens: int, threads: int, cache: Path) -> Answers:
    """The first n prompts (the bench's order) with the target's greedy answers; cached per prompt."""
    done: dict[str, dict] = {}
    if cache.exists():
        done = {r["id"]: r for r in json.loads(cache.read_text())}
    prompts = select_prompts(load_prompts(prompt_file), n)
    missing = [p for p in prompts if p.id not in done or done[p.id]["max_new_tokens"] < max_new_tokens]
    if missing:
        torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target).eval()
        verifier = Verifier(CausalLMRunner(model))
        # Greedy tokens are the target's whatever drafts; a learning drafter only makes this faster.
        helper = SuffixDrafter(verifier.vocab_size)
        eos = getattr(model.generation_config, "eos_token_id", None)
        stop = ({tok.eos_token_id} | ({eos} if isinstance(eos, int) else set(eos or []))) - {None}
        for i, p in enumerate(missing):
            ids = tokenize_prompt(tok, p)
            got = speculative_generate(
                ids,
                verifier,
                helper,
                GREEDY,
                draft_length=16,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop,
                session_id=p.id,
            )
            done[p.id] = {"id": p.id, "prompt": ids, "answer": got.token_ids, "max_new_tokens": max_new_tokens}
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(list(done.values())))
            print(
                f"generated {i + 1}/{len(missing)} ({p.id}, {len(got.token_ids)} tokens, {got.seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return [(done[p.id]["prompt"], done[p.id]["answer"][:max_new_tokens]) for p in prompts]


def replay(
    data: Answers,
    make: Callable[[int], Drafter | None],
    k: int,
    base_ms: float,
    per_token_ms: float,
    finish: bool = True,
) -> list[tuple[int, int, float]]:
    """Per request: (tokens, rounds, modelled ms) with one drafter instance serving them in sequence."""
    vocab = 1 + max(max(p + a) for p, a in data)
    drafter = make(vocab)
    out = []
    for r, (prompt, answer) in enumerate(data):
        sid = f"r{r}"
        committed, known = list(prompt), len(prompt)
        if drafter is not None:
            drafter.open(sid, prompt, GREEDY)
        i = rounds = 0
        ms = 0.0
        while i < len(answer):
            proposal = []
            if drafter is not None:
                budget = min(k, len(answer) - i - 1)
                if budget > 0:
                    proposal = drafter.propose(
                        ProposeRequest(sid, len(committed), known, committed[known:], budget)
                    ).token_ids
            accepted = 0
            while accepted < len(proposal) and answer[i + accepted] == proposal[accepted]:
                accepted += 1
            n = accepted + 1
            if proposal:
                known = len(committed) + accepted
            committed += answer[i : i + n]
            i += n
            rounds += 1
            ms += base_ms + per_token_ms * (len(proposal) + 1)
        if drafter is not None:
            if finish and isinstance(drafter, LearningDrafter):  # the close carries the committed tail
                drafter.finish(sid, len(committed), known, committed[known:])
            drafter.close(sid)
        out.append((len(answer), rounds, ms))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(Path.home() / ".cache/specd/smollm2-135m-instruct"))
    parser.add_argument("--prompt-file", default="repetitive")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default="bench-results/greedy-answers-repetitive.json")
    parser.add_argument("--k", type=int, default=16, help="largest K a round may propose")
    parser.add_argument("--warm", type=int, default=15, help="requests before the steady-state figures")
    parser.add_argument("--groups", type=int, default=6, help="points of the warm-up curve")
    parser.add_argument("--base-ms", type=float, default=70.0, help="verify cost model: base + per_token (K + 1)")
    parser.add_argument("--per-token-ms", type=float, default=10.0)
    args = parser.parse_args()
    data = greedy_answers(
        args.target, args.prompt_file, args.prompts, args.max_new_tokens, args.threads, Path(args.cache)
    )
    base = SuffixSettings()
    policies: dict[str, Callable[[int], Drafter | None]] = {
        "target-only": lambda v: None,
        "ngram (capped)": lambda v: NgramDrafter(v),
        "suffix": lambda v: SuffixDrafter(v, base),
        "suffix, no fallback": lambda v: SuffixDrafter(v, replace(base, fallback="none")),
        "suffix, outputs only": lambda v: SuffixDrafter(v, replace(base, prompt_tail=0)),
        "suffix, whole prompts": lambda v: SuffixDrafter(v, replace(base, prompt_tail=-1)),
        "suffix, no global index": lambda v: SuffixDrafter(v, replace(base, index_bytes=0)),
        "suffix, global anchor 3": lambda v: SuffixDrafter(v, replace(base, global_anchor=3)),
        "suffix, min prob 0.3": lambda v: SuffixDrafter(v, replace(base, min_token_prob=0.3)),
        "suffix, min prob 0.05": lambda v: SuffixDrafter(v, replace(base, min_token_prob=0.05)),
        "suffix, factor 2": lambda v: SuffixDrafter(v, replace(base, max_spec_factor=2.0)),
    }
    n = len(data)
    warm = min(args.warm, n - 1)
    bounds = [round(g * n / args.groups) for g in range(args.groups + 1)]
    print(f"{n} requests in sequence; K <= {args.k}; verify cost {args.base_ms:g} + {args.per_token_ms:g} (K + 1) ms")
    header = f"{'policy':28s} {'tok/round':>9s} {'tok/s':>6s} {'after ' + str(warm):>9s} {'x t-only':>8s}"
    curve_header = " ".join(f"{a + 1}-{b}".rjust(7) for a, b in pairwise(bounds))
    print(header + "  warm-up curve (x target-only by request index): " + curve_header)
    results = {name: replay(data, make, args.k, args.base_ms, args.per_token_ms) for name, make in policies.items()}
    # Before the close carried the committed tail, the draft learnt a session only from its proposes.
    results["suffix, learning from proposes only"] = replay(
        data, policies["suffix"], args.k, args.base_ms, args.per_token_ms, finish=False
    )
    ref = results["target-only"]

    def speed(rows: list[tuple[int, int, float]]) -> float:
        return sum(t for t, _, _ in rows) / sum(ms for _, _, ms in rows) * 1e3

    for name, rows in results.items():
        per_round = sum(t for t, _, _ in rows) / sum(r for _, r, _ in rows)
        steady = speed(rows[warm:])
        curve = " ".join(f"{speed(rows[a:b]) / speed(ref[a:b]):7.2f}" for a, b in pairwise(bounds) if b > a)
        print(
            f"{name:28s} {per_round:9.2f} {speed(rows):6.1f} {steady:9.1f} {steady / speed(ref[warm:]):8.2f}  {curve}"
        )


if __name__ == "__main__":
    main()
