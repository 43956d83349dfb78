"""The demo pair in-process: batched rounds equal target-only greedy (SmolLM2-135M; the tiny pair: tests/unit/core/test_inprocess.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.inprocess import speculative_generate, speculative_generate_batch
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)


# Eight prompts of different lengths and kinds (prose, code, SQL, a letter): batched rounds pad and
# roll back each one differently. Each reference is target-only decoding, one token per forward
# (twenty prompts took 27 s of set-up).
DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):",
    "SELECT * FROM users WHERE",
    "Dear Sir or Madam,",
    "#include <stdio.h>\nint main() {",
]


@pytest.fixture(scope="module")
def demo_pair(demo_target_dir: Path):
    return _demo_pair(demo_target_dir)


def _demo_pair(demo_target_dir: Path):
    loaded = load_pretrained(demo_target_dir)
    # A tiny random draft sharing the demo vocabulary: almost nothing is accepted, so
    # every round exercises rejection and recovery.
    cfg = LlamaConfig(
        vocab_size=loaded.model.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    tiny_draft = LlamaForCausalLM(cfg).eval()
    verifier = Verifier(CausalLMRunner(loaded.model))
    references = {}
    for text in DEMO_PROMPTS:  # target-only greedy, computed once for every K
        prompt = loaded.tokenizer(text).input_ids
        references[text] = speculative_generate(
            prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=10
        ).token_ids
    return (
        loaded,
        verifier,
        references,
        ModelDrafter(CausalLMRunner(tiny_draft)),
        ModelDrafter(CausalLMRunner(loaded.model)),
    )


@pytest.mark.demo
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_demo_greedy_parity(demo_pair, k: int) -> None:
    """All prompts in lock-step through batched rounds (as the services run them under load)
    equal target-only decoding one prompt at a time, one token per forward."""
    loaded, verifier, references, tiny_draft, self_draft = demo_pair
    prompts = [loaded.tokenizer(text).input_ids for text in DEMO_PROMPTS]
    for drafter in (tiny_draft, self_draft):
        got = speculative_generate_batch(
            prompts, verifier, drafter, [GREEDY] * len(prompts), draft_lengths=[k] * len(prompts), max_new_tokens=10
        )
        for text, g in zip(DEMO_PROMPTS, got):
            assert g.token_ids == references[text], (text, k, drafter is self_draft)
