"""Measuring a draft in-process: acceptance at temperature 0, the cost ratio c, tokens/s against target-only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.protocol import Drafter
from specd.core.inprocess import speculative_generate
from specd.core.model.draft_checkpoint import install_reduced_head
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.tools.distill.prompts import render_prompt
from specd.tools.distill.teacher import eos_ids


def _median_forward_ms(runner, prompt: list[int], repeats: int) -> float:
    """Median ms of a 1-token cached forward after `prompt` (the per-token cost while drafting/decoding)."""
    s = runner.new_session(prompt)
    runner.logits(s, 1)
    times = []
    for i in range(repeats):
        runner.append(s, [prompt[i % len(prompt)]])
        t0 = time.perf_counter()
        runner.logits(s, 1)
        times.append((time.perf_counter() - t0) * 1e3)
        runner.truncate(s, len(prompt))
    return statistics.median(times)


def evaluate(
    target_folder: Path,
    draft: str | Path,
    prompts: Sequence[str | tuple[str, bool]],
    *,
    max_new_tokens: int = 64,
    draft_length: int = 4,
    chat: bool = True,
    threads: int = 0,
    repeats: int = 30,
    baseline: bool = True,
    progress: bool = True,
) -> dict[str, object]:
    """Acceptance (temperature 0), cost ratio c and tokens/s vs target-only, in-process.

    prompts: texts (chat-formatted when `chat`), or (text, chat?) pairs.
    draft: a model folder, or 'ngram' (prompt lookup). Spec and target-only
    runs alternate per prompt in the same process, so load changes hit both.
    """
    if threads:
        torch.set_num_threads(threads)
    target = load_pretrained(target_folder)
    t_runner = CausalLMRunner(target.model)
    verifier = Verifier(t_runner)
    eos = sorted(eos_ids(target.model, target.tokenizer))
    c = draft_ms = None
    drafter: Drafter
    if str(draft) == "ngram":
        drafter = NgramDrafter(t_runner.vocab_size)
    else:
        loaded = load_pretrained(Path(draft))
        token_map = install_reduced_head(loaded.model, Path(draft))
        d_runner = CausalLMRunner(loaded.model)
        drafter = ModelDrafter(d_runner, token_map=token_map)
    pairs = [(p, chat) if isinstance(p, str) else (p[0], bool(p[1])) for p in prompts]
    ids = [render_prompt(target.tokenizer, text, as_chat) for text, as_chat in pairs]
    greedy = SamplingParams(temperature=0.0)
    target_ms = _median_forward_ms(t_runner, ids[0], repeats)
    if str(draft) != "ngram":
        draft_ms = _median_forward_ms(d_runner, ids[0], repeats)
        c = draft_ms / target_ms
    spec_tokens = spec_s = base_tokens = base_s = 0.0
    draft_tokens = accepted = rounds = 0
    mismatches = 0
    per_prompt = []
    for i, prompt in enumerate(tqdm(ids, desc="evaluate", unit="prompt", disable=not progress)):
        got = speculative_generate(
            prompt,
            verifier,
            drafter,
            greedy,
            draft_length=draft_length,
            max_new_tokens=max_new_tokens,
            stop_token_ids=eos,
            session_id=f"s{i}",
        )
        spec_tokens += len(got.token_ids)
        spec_s += got.seconds
        draft_tokens += got.stats.draft_tokens
        accepted += got.stats.accepted_tokens
        rounds += got.stats.rounds
        row = {
            "prompt": pairs[i][0],
            "chat": pairs[i][1],
            "tokens": len(got.token_ids),
            "acceptance_rate": got.stats.acceptance_rate,
            "spec_s": got.seconds,
        }
        if baseline:
            ref = speculative_generate(
                prompt,
                verifier,
                None,
                greedy,
                draft_length=0,
                max_new_tokens=max_new_tokens,
                stop_token_ids=eos,
                session_id=f"b{i}",
            )
            base_tokens += len(ref.token_ids)
            base_s += ref.seconds
            mismatches += int(ref.token_ids != got.token_ids)
            row["target_only_s"] = ref.seconds
        per_prompt.append(row)
    a = accepted / draft_tokens if draft_tokens else 0.0
    result: dict[str, object] = {
        "draft": str(draft),
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "draft_length": draft_length,
        "threads": torch.get_num_threads(),
        "acceptance_rate": a,
        "acceptance_length": 1 + accepted / rounds if rounds else 1.0,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "target_forward_ms": target_ms,
        "draft_forward_ms": draft_ms,
        "c": c,
        "spec_tokens_per_s": spec_tokens / spec_s if spec_s else 0.0,
        "per_prompt": per_prompt,
    }
    if baseline:
        result["target_only_tokens_per_s"] = base_tokens / base_s if base_s else 0.0
        result["speedup"] = (spec_tokens / spec_s) / (base_tokens / base_s) if base_s and spec_s else 0.0
        result["outputs_differ"] = mismatches  # must be 0: greedy speculation is token-for-token exact
    return result
