#!/usr/bin/env python
"""Simulate n-gram (prompt lookup) drafting policies on the target's own greedy answers.

Generates the target's greedy answers to a prompt set once (in-process), then
replays each policy round by round: propose with `lookup_continuation`, accept
the agreeing prefix, commit it plus one target token. Reports tokens per round
and tokens/s under a linear verify-cost model T(K) = base + per_token (K + 1) ms,
so policies that propose more per round pay for it.

    .venv/bin/python scripts/ngram_policy.py [--prompt-file edit] [--prompts 32] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.core.draft.ngram import lookup_continuation
from specd.tools.bench.prompts import load_prompts, select_prompts, shipped_prompt_file, tokenize_prompt

Lookup = Callable[[list[int]], list[int]]


def greedy_answers(
    target: str, prompt_file: str, n: int, max_new_tokens: int, threads: int
) -> list[tuple[list[int], list[int]]]:
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    path = shipped_prompt_file(prompt_file) if not Path(prompt_file).exists() else Path(prompt_file)
    out = []
    for p in select_prompts(load_prompts(path), n):
        ids = tokenize_prompt(tok, p)
        with torch.no_grad():  # prompt lookup only speeds this up; greedy tokens are the target's
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, prompt_lookup_num_tokens=4
            )
        out.append((ids, gen[0, len(ids) :].tolist()))
    return out


def latest_match(tokens: list[int], k: int, max_ngram: int) -> list[int]:
    """The old policy, for comparison: continue the latest earlier match instead of the earliest."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        suffix = tokens[n_tokens - n :]
        for begin in range(n_tokens - n - 1, -1, -1):
            if tokens[begin : begin + n] == suffix:
                return tokens[begin + n : begin + n + k]
    return []


def replay(
    data: list[tuple[list[int], list[int]]], lookup: Lookup, base_ms: float, per_token_ms: float
) -> tuple[float, float]:
    """(tokens per round, tokens/s) of a policy over every answer."""
    tokens = rounds = 0
    cost_ms = 0.0
    for prompt, answer in data:
        context, i = list(prompt), 0
        while i < len(answer):
            proposal = lookup(context)
            accepted = 0
            while (
                accepted < len(proposal) and i + accepted < len(answer) and answer[i + accepted] == proposal[accepted]
            ):
                accepted += 1
            n = min(accepted + 1, len(answer) - i)
            context += answer[i : i + n]
            i += n
            tokens += n
            rounds += 1
            cost_ms += base_ms + per_token_ms * (len(proposal) + 1)
    return tokens / rounds, tokens / cost_ms * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(Path.home() / ".cache/specd/smollm2-135m-instruct"))
    parser.add_argument("--prompt-file", default="edit")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--base-ms", type=float, default=70.0, help="verify cost model: base + per_token (K + 1)")
    parser.add_argument("--per-token-ms", type=float, default=10.0)
    args = parser.parse_args()
    data = greedy_answers(args.target, args.prompt_file, args.prompts, args.max_new_tokens, args.threads)
    policies: dict[str, Lookup] = {"target-only": lambda ctx: []}
    for k in (2, 4, 6, 8, 12):
        policies[f"fixed-{k} (n<=3)"] = lambda ctx, k=k: lookup_continuation(ctx, k, 3, 1)
        policies[f"fixed-{k} (n<=3, latest match)"] = lambda ctx, k=k: latest_match(ctx, k, 3)
        policies[f"fixed-{k} (n<=2, transformers')"] = lambda ctx, k=k: lookup_continuation(ctx, k, 2, 1)
        policies[f"capped-{k} (n<=3)"] = lambda ctx, k=k: lookup_continuation(ctx, k, 3, 1, cap_at_match=True)
    print(f"{len(data)} prompts; verify cost {args.base_ms:g} + {args.per_token_ms:g} (K + 1) ms")
    print(f"{'policy':36s} {'tokens/round':>12s} {'tokens/s':>9s}")
    for name, lookup in policies.items():
        per_round, per_s = replay(data, lookup, args.base_ms, args.per_token_ms)
        print(f"{name:36s} {per_round:12.2f} {per_s:9.1f}")


if __name__ == "__main__":
    main()
