"""Tree rounds in-process, plain and pipelined: greedy parity with target-only for every drafter, seeded
reproducibility."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.errors import InvalidArgument
from specd.core.inprocess import speculative_generate, speculative_generate_batch
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    verifier = Verifier(CausalLMRunner(t.model))
    drafters = {
        "model": ModelDrafter(CausalLMRunner(d.model)),
        "self": ModelDrafter(CausalLMRunner(t.model)),
        "ngram": NgramDrafter(verifier.vocab_size),
        "suffix": SuffixDrafter(verifier.vocab_size),
    }
    return t.tokenizer, verifier, drafters


@pytest.mark.parametrize("kind", ["model", "self", "ngram", "suffix"])
def test_greedy_tree_rounds_spell_target_only(tiny, kind: str) -> None:
    tok, verifier, drafters = tiny
    for text in ["abc abc abc abc", "def f(x):"]:
        prompt = tok(text).input_ids
        ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=16).token_ids
        got = speculative_generate(
            prompt, verifier, drafters[kind], GREEDY, draft_length=4, max_new_tokens=16, tree_budget=8
        )
        assert got.token_ids == ref
        s = got.stats
        assert s.accepted_tokens + s.rounds == len(ref)  # each round commits its path + 1
        if kind == "self":  # the target as its own draft: its argmax is among the prefix's children
            assert s.accepted_tokens >= s.drafts


def test_seeded_tree_rounds_reproduce_and_batch_as_alone(tiny) -> None:
    tok, verifier, drafters = tiny
    prompts = [tok(t).input_ids for t in ("sampling", "hello world")]
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=20, seed=6)]
    model = drafters["model"]
    alone = [
        speculative_generate(p, verifier, model, q, draft_length=3, max_new_tokens=20, tree_budget=6).token_ids
        for p, q in zip(prompts, params)
    ]
    again = speculative_generate(
        prompts[0], verifier, model, params[0], draft_length=3, max_new_tokens=20, tree_budget=6
    )
    assert again.token_ids == alone[0] and len(alone[0]) == 20
    batch = speculative_generate_batch(
        prompts, verifier, model, params, draft_lengths=[3, 3], max_new_tokens=20, tree_budget=6
    )
    assert [r.token_ids for r in batch] == alone
    other = speculative_generate(
        prompts[0],
        verifier,
        model,
        SamplingParams(temperature=1.0, seed=50),
        draft_length=3,
        max_new_tokens=20,
        tree_budget=6,
    )
    assert other.token_ids != alone[0]


@pytest.mark.parametrize("kind", ["model", "self", "ngram", "suffix"])
def test_pipelined_greedy_tree_rounds_spell_target_only_and_hit(tiny, kind: str) -> None:
    tok, verifier, drafters = tiny
    hits = 0
    for text in ["abc abc abc abc abc abc", "def f(x):"]:
        prompt = tok(text).input_ids
        ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=24).token_ids
        got = speculative_generate(
            prompt, verifier, drafters[kind], GREEDY, draft_length=3, max_new_tokens=24, tree_budget=8,
            pipeline="bonus-match",
        )  # fmt: skip
        assert got.token_ids == ref
        s = got.stats
        assert s.accepted_tokens + s.rounds == len(ref)
        hits += s.pipeline_hits
    if kind == "self":  # the target drafting for itself: every first path is accepted, its bonus guessed
        assert hits > 0


def test_pipelined_seeded_tree_rounds_reproduce_and_batch_as_alone(tiny) -> None:
    """At T > 0 a hit verifies the pre-draft's subtree, another tree than a fresh draft's: the tokens are
    not the unpipelined rounds' but still a function of the seeds alone (alone, again, batched)."""
    tok, verifier, drafters = tiny
    prompts = [tok(t).input_ids for t in ("sampling", "hello world")]
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.8, top_k=20, seed=6)]
    model = drafters["self"]
    piped = dict(draft_length=3, max_new_tokens=20, tree_budget=6, pipeline="bonus-match")
    alone = [speculative_generate(p, verifier, model, q, **piped) for p, q in zip(prompts, params)]
    assert sum(r.stats.pipeline_hits for r in alone) > 0
    again = speculative_generate(prompts[0], verifier, model, params[0], **piped)
    assert again.token_ids == alone[0].token_ids and len(alone[0].token_ids) == 20
    batch = speculative_generate_batch(prompts, verifier, model, params, draft_lengths=[3, 3], **{
        k: v for k, v in piped.items() if k != "draft_length"
    })  # fmt: skip
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


def test_tree_rounds_refuse_what_they_do_not_run(tiny) -> None:
    tok, verifier, drafters = tiny
    prompt = tok("x").input_ids
    for pipeline in ("spec-cache", "post-verify"):
        with pytest.raises(InvalidArgument, match="pipeline"):
            speculative_generate(
                prompt,
                verifier,
                drafters["model"],
                GREEDY,
                draft_length=3,
                max_new_tokens=4,
                tree_budget=4,
                pipeline=pipeline,
            )
    with pytest.raises(InvalidArgument, match="depth"):
        speculative_generate(
            prompt, verifier, drafters["model"], GREEDY, draft_length=0, max_new_tokens=4, tree_budget=4
        )
    assert verifier.active_sessions() == 0
