"""The round logic in-process: parity with target-only decoding, stop rules, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter, lookup_continuation
from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.inprocess import speculative_generate, speculative_generate_batch
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.generation import FinishReason, Generation, StopRule
from specd.core.rounds.record import TargetOnly
from specd.core.rounds.steps import ProposeRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    return (
        t,
        Verifier(CausalLMRunner(t.model)),
        ModelDrafter(CausalLMRunner(d.model)),
        ModelDrafter(CausalLMRunner(t.model)),
    )


def _plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding with Hugging Face's own generate (an independent oracle)."""
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()  # may stop early at end-of-sequence


@pytest.mark.parametrize("k", [1, 4, 8])
def test_tiny_greedy_parity(tiny, k: int) -> None:
    loaded, verifier, drafter, self_drafter = tiny
    for text in ["hello world", "def f(x):", "abcabcabc", "The end."]:
        prompt = loaded.tokenizer(text).input_ids
        ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=20).token_ids
        hf = _plain_greedy(loaded.model, prompt, 20)
        assert ref[: len(hf)] == hf
        for d in (drafter, self_drafter):
            got = speculative_generate(prompt, verifier, d, GREEDY, draft_length=k, max_new_tokens=20)
            assert got.token_ids == ref
        # the target as its own draft accepts every greedy draft token
        assert got.stats.accepted_tokens == got.stats.draft_tokens


def test_a_model_draft_says_how_sure_each_token_is(tiny) -> None:
    """Greedy: the draft softmax's top probability; sampled: q(token), the mass the token was drawn with."""
    loaded, _, drafter, _ = tiny
    prompt = loaded.tokenizer("def f(x):").input_ids
    drafter.open("greedy", prompt, GREEDY)
    greedy = drafter.propose(ProposeRequest("greedy", len(prompt), len(prompt), [], 4))
    drafter.close("greedy")
    with torch.no_grad():
        first = torch.softmax(drafter.runner.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert len(greedy.confidence) == 4 and all(0.0 < c <= 1.0 for c in greedy.confidence)
    assert greedy.confidence[0] == pytest.approx(float(first.max()), rel=1e-4)
    drafter.open("sampled", prompt, SamplingParams(temperature=0.8, seed=3))
    sampled = drafter.propose(ProposeRequest("sampled", len(prompt), len(prompt), [], 4))
    drafter.close("sampled")
    assert sampled.q_ids is not None and sampled.q_probs is not None and len(sampled.confidence) == 4
    for i, token in enumerate(sampled.token_ids):
        row = sampled.q_probs[i] / sampled.q_probs[i].sum()
        assert sampled.confidence[i] == pytest.approx(float(row[sampled.q_ids[i] == token].sum()), rel=1e-5)


@pytest.mark.parametrize("speculation, wanted", [("fixed", False), ("auto", True)])
def test_only_auto_asks_the_draft_for_its_confidence(tiny, monkeypatch, speculation: str, wanted: bool) -> None:
    """Auto cuts and calibrates by the draft tokens' confidence; a fixed request reads none, so its draft
    session opens without (sparing the model draft a softmax per greedy row), with the same tokens."""
    loaded, verifier, drafter, _ = tiny
    opened: list[bool] = []
    real = drafter.open

    def open_(*args, confidence: bool = True, **kwargs) -> None:
        opened.append(confidence)
        real(*args, confidence=confidence, **kwargs)

    monkeypatch.setattr(drafter, "open", open_)
    prompt = loaded.tokenizer("def f(x):").input_ids
    got = speculative_generate(
        prompt, verifier, drafter, GREEDY, draft_length=3, max_new_tokens=12, speculation=speculation
    )
    assert opened and set(opened) == {wanted}
    assert got.token_ids == _plain_greedy(loaded.model, prompt, 12)[: len(got.token_ids)]


def test_same_seed_same_output_and_stats_add_up(tiny) -> None:
    loaded, verifier, drafter, _ = tiny
    prompt = loaded.tokenizer("sampling").input_ids
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    a = speculative_generate(prompt, verifier, drafter, params, draft_length=4, max_new_tokens=30)
    b = speculative_generate(prompt, verifier, drafter, params, draft_length=4, max_new_tokens=30)
    assert a.token_ids == b.token_ids
    other = speculative_generate(
        prompt,
        verifier,
        drafter,
        SamplingParams(temperature=0.9, top_p=0.95, seed=8),
        draft_length=4,
        max_new_tokens=30,
    )
    assert other.token_ids != a.token_ids
    s = a.stats
    assert len(a.token_ids) == 30 and s.accepted_tokens + s.rounds == 30  # each round commits accepted + 1
    assert sum(s.accepted_per_position) == s.accepted_tokens


def test_ngram_drafter_is_exact(tiny) -> None:
    loaded, verifier, _, _ = tiny
    ngram = NgramDrafter(verifier.vocab_size)
    prompt = loaded.tokenizer("abc abc abc abc abc abc").input_ids
    ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=24).token_ids
    got = speculative_generate(prompt, verifier, ngram, GREEDY, draft_length=4, max_new_tokens=24)
    assert got.token_ids == ref
    assert got.stats.draft_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pipelining_and_auto_run_in_process_too(tiny, temperature: float) -> None:
    """The in-process oracle is the coordinator's loop: bonus-match pipelining changes no token (the
    pre-draft is used only for the committed prefix), post-verify is seeded-deterministic (and greedy
    parity), automatic K is exact."""
    loaded, verifier, _, self_drafter = tiny
    prompt = loaded.tokenizer("pipelines").input_ids
    params = SamplingParams(temperature=temperature, seed=11)
    plain = speculative_generate(prompt, verifier, self_drafter, params, draft_length=3, max_new_tokens=24)
    piped = speculative_generate(
        prompt, verifier, self_drafter, params, draft_length=3, max_new_tokens=24, pipeline="bonus-match"
    )
    assert piped.token_ids == plain.token_ids
    # A bonus-match hit needs the draft's guess to equal the bonus: certain at T = 0 with the target as
    # its own draft, but at T > 0 the two are drawn with independent coins (probability sum p^2 per
    # round, small for a random model), so only greedy must hit.
    assert piped.stats.pipeline_hits > 0 or temperature > 0
    # (0:bonus: the opening's guess of the first token, beside the target's prefill of the prompt)
    assert set(piped.stats.pipeline_hits_by_outcome) <= {f"{k}:bonus" for k in range(0, 4)}
    assert piped.stats.pipeline_hits_by_outcome.get("0:bonus", 0) <= 1  # one opening a request
    post = [
        speculative_generate(
            prompt, verifier, self_drafter, params, draft_length=3, max_new_tokens=24, pipeline="post-verify"
        )
        for _ in range(2)
    ]
    assert post[0].token_ids == post[1].token_ids and post[0].stats.pipeline_hits > 0
    auto = speculative_generate(
        prompt, verifier, self_drafter, params, draft_length=4, max_new_tokens=24, speculation="auto"
    )
    if temperature == 0.0:
        assert post[0].token_ids == plain.token_ids and auto.token_ids == plain.token_ids
    assert auto.stats.draft_tokens > 0
    for result in (plain, piped, post[0], auto):
        assert [t for r in result.records for t in r.committed] == result.token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_spec_cache_changes_no_token_in_process(tiny, temperature: float) -> None:
    """The in-process oracle runs the speculation cache: a branch drafts what a fresh propose would, so the
    output is the output without pipelining, greedy and seeded; the target as its own draft hits."""
    loaded, verifier, drafter, self_drafter = tiny
    prompt = loaded.tokenizer("speculation cache").input_ids
    params = SamplingParams(temperature=temperature, seed=5)
    for d in (drafter, self_drafter):
        plain = speculative_generate(prompt, verifier, d, params, draft_length=3, max_new_tokens=24)
        cached = speculative_generate(
            prompt, verifier, d, params, draft_length=3, max_new_tokens=24, pipeline="spec-cache"
        )
        assert cached.token_ids == plain.token_ids
        assert [t for r in cached.records for t in r.committed] == cached.token_ids
    assert cached.stats.pipeline_hits > 0 or temperature > 0  # (a random model's bonus is hard to guess at T > 0)
    ngram = NgramDrafter(verifier.vocab_size)
    text = loaded.tokenizer("abc abc abc abc abc abc").input_ids
    ref = speculative_generate(text, verifier, None, GREEDY, draft_length=0, max_new_tokens=24).token_ids
    got = speculative_generate(text, verifier, ngram, GREEDY, draft_length=4, max_new_tokens=24, pipeline="spec-cache")
    assert got.token_ids == ref and got.stats.draft_tokens > 0
    assert set(got.stats.pipeline_hits_by_outcome) <= {f"{k}:bonus" for k in range(1, 5)}  # its bonus guess only


def test_batched_requests_share_forward_passes(tiny) -> None:
    loaded, verifier, drafter, _ = tiny
    sizes = {"verify": [], "propose": []}
    real_verify, real_propose = verifier.verify_batch, drafter.propose_batch

    def verify_batch(requests):
        sizes["verify"].append(len(requests))
        return real_verify(requests)

    def propose_batch(requests):
        sizes["propose"].append(len(requests))
        return real_propose(requests)

    prompts = [loaded.tokenizer(t).input_ids for t in ("one", "two two", "three three three")]
    verifier.verify_batch, drafter.propose_batch = verify_batch, propose_batch
    try:
        got = speculative_generate_batch(
            prompts, verifier, drafter, [GREEDY] * 3, draft_lengths=[2, 3, 4], max_new_tokens=12
        )
    finally:
        del verifier.verify_batch, drafter.propose_batch
    assert max(sizes["verify"]) == 3 and max(sizes["propose"]) == 3
    for p, g in zip(prompts, got):
        assert (
            g.token_ids == speculative_generate(p, verifier, None, GREEDY, draft_length=0, max_new_tokens=12).token_ids
        )


def test_an_ngram_proposal_scores_its_match_by_how_far_back_it_agrees() -> None:
    drafter = NgramDrafter(100, max_ngram=2)
    drafter.open("s", [7, 8, 1, 2, 3, 4, 5, 9, 1, 2], GREEDY)
    short = drafter.propose(ProposeRequest("s", 10, 10, [], 3))  # "1 2" agrees over 2 tokens (9 != 8 before it)
    assert short.token_ids == [3, 4] and short.confidence == (2 / 3, 2 / 3)
    drafter.open("t", [7, 8, 1, 2, 3, 4, 5, 7, 8, 1, 2], GREEDY)
    long = drafter.propose(ProposeRequest("t", 11, 11, [], 3))  # "7 8 1 2" agrees over 4
    assert long.token_ids == [3, 4, 5] and long.confidence == (0.8, 0.8, 0.8)
    drafter.open("u", [1, 2, 3], GREEDY)
    assert drafter.propose(ProposeRequest("u", 3, 3, [], 3)).confidence == ()  # no match, no score


def test_lookup_continuation() -> None:
    assert lookup_continuation([1, 2, 3, 9, 1, 2], 2, 3, 1) == [3, 9]
    assert lookup_continuation([5, 1, 2, 7, 1, 2, 8, 1, 2], 3, 2, 1) == [7, 1, 2]  # the earliest match wins
    assert lookup_continuation([9, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3], 2, 3, 1) == [6, 1]  # the longest n-gram first
    assert lookup_continuation([1, 2, 3], 4, 3, 1) == []
    assert lookup_continuation([4, 4], 3, 3, 1) == [4]


def test_lookup_capped_at_the_agreeing_context() -> None:
    # "1 2" follows 7 in one place and 8 in the other: only the n-gram agrees (L = 2), so at most 2 tokens
    assert lookup_continuation([7, 1, 2, 3, 4, 5, 6, 8, 1, 2], 6, 3, 1, cap_at_match=True) == [3, 4]
    assert lookup_continuation([7, 1, 2, 3, 4, 5, 6, 8, 1, 2], 6, 3, 1) == [3, 4, 5, 6, 8, 1]
    # the context agrees back past the n-gram: "5 6 7 1 2" twice (L = 5), so 5 of the 6 asked for
    seq = [5, 6, 7, 1, 2, 3, 4, 9, 9, 9, 9, 9, 0, 5, 6, 7, 1, 2]
    assert lookup_continuation(seq, 6, 2, 1, cap_at_match=True) == [3, 4, 9, 9, 9]
    assert lookup_continuation(seq, 3, 2, 1, cap_at_match=True) == [3, 4, 9]  # never more than k
    assert lookup_continuation([1, 2, 3], 4, 3, 1, cap_at_match=True) == []  # no match, nothing
    assert lookup_continuation([4, 4], 3, 3, 1, cap_at_match=True) == [4]  # a match always proposes >= 1


def test_capped_ngram_drafter_is_exact(tiny) -> None:
    loaded, verifier, _, _ = tiny
    prompt = loaded.tokenizer("def f(x):\n    return x + 1\n\ndef f(x):\n    return").input_ids
    ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=24).token_ids
    for cap in (True, False):
        got = speculative_generate(
            prompt,
            verifier,
            NgramDrafter(verifier.vocab_size, cap_at_match=cap),
            GREEDY,
            draft_length=8,
            max_new_tokens=24,
        )
        assert got.token_ids == ref
        assert got.stats.draft_tokens > 0  # the drafter did propose: parity is not target-only's by default


def test_generation_stops_and_budget() -> None:
    gen = Generation([1, 2, 3], StopRule(max_new_tokens=5, max_context=100, stop_token_ids=frozenset({9})))
    assert gen.draft_budget(8) == 4  # 5 remaining -> at most 4 drafts + 1
    assert gen.commit([4, 5, 9, 6], accepted=4, token=7) == [4, 5, 9]
    assert gen.finish_reason == FinishReason.STOP_TOKEN and gen.generated == [4, 5, 9]
    gen = Generation([1], StopRule(max_new_tokens=3, max_context=100))
    assert gen.commit([4, 5, 6], accepted=3, token=7) == [4, 5, 6]
    assert gen.finish_reason == FinishReason.LENGTH
    gen = Generation([1, 2], StopRule(max_new_tokens=50, max_context=4))
    assert gen.draft_budget(8) == 1
    gen.commit([3], accepted=1, token=4)
    assert gen.finish_reason == FinishReason.CONTEXT_FULL and gen.committed_length == 4


def test_bad_input_raises_typed_errors(tiny) -> None:
    loaded, verifier, drafter, _ = tiny
    prompt = loaded.tokenizer("x").input_ids
    cases = [
        (lambda: speculative_generate([], verifier, None, GREEDY, draft_length=0, max_new_tokens=4), "empty"),
        (lambda: speculative_generate([10**6], verifier, None, GREEDY, draft_length=0, max_new_tokens=4), "vocabulary"),
        (
            lambda: speculative_generate(prompt, verifier, drafter, GREEDY, draft_length=0, max_new_tokens=4),
            "draft length",
        ),
        (
            lambda: speculative_generate(
                prompt, verifier, None, SamplingParams(top_p=0.0), draft_length=0, max_new_tokens=4
            ),
            "top_p",
        ),
        (
            lambda: speculative_generate(
                prompt, verifier, None, SamplingParams(top_p=1.5), draft_length=0, max_new_tokens=4
            ),
            "top_p",
        ),
        (
            lambda: speculative_generate(
                prompt, verifier, None, SamplingParams(temperature=-0.5), draft_length=0, max_new_tokens=4
            ),
            "temperature",
        ),
        (
            lambda: speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=0),
            "max_new_tokens",
        ),
        (
            lambda: speculative_generate(prompt * 600, verifier, None, GREEDY, draft_length=0, max_new_tokens=4),
            "context",
        ),
    ]
    for call, needle in cases:
        with pytest.raises(InvalidArgument, match=needle):
            call()
    drafter.open("k", prompt, GREEDY)
    with pytest.raises(InvalidArgument, match="num_tokens"):
        drafter.propose(ProposeRequest("k", len(prompt), len(prompt), [], 0))
    with pytest.raises(SessionOutOfSync):
        drafter.propose(ProposeRequest("k", len(prompt) + 5, len(prompt) + 5, [], 2))
    drafter.close("k")
    verifier.open("v", prompt, GREEDY)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        verifier.verify(VerifyRequest("v", len(prompt), Proposal([10**6])))
    verifier.close("v")


def test_verifier_rolls_back_an_unseen_verdict(tiny) -> None:
    """A retried round (the coordinator missed the answer) gives the same verdict."""
    loaded, verifier, _, _ = tiny
    prompt = loaded.tokenizer("retry me").input_ids
    verifier.open("r", prompt, SamplingParams(temperature=1.0, seed=3))
    first = verifier.verify(VerifyRequest("r", len(prompt), Proposal([65, 66]), start=len(prompt)))
    again = verifier.verify(VerifyRequest("r", len(prompt), Proposal([65, 66]), start=len(prompt)))
    assert first == type(first)(**{**again.__dict__, "compute_ms": first.compute_ms})
    verifier.close("r")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_an_opening_beside_changes_no_token_between_pipelines(tiny, temperature: float) -> None:
    """With the target's prefill alone in the opening round (the draft's first call beside it), every
    pipeline still emits the same tokens for a seed: which opening runs depends on the setting alone,
    and a pre-draft is used only for the prefix the verdict commits. Greedy: the target's own tokens."""
    loaded, verifier, drafter, self_drafter = tiny
    prompt = loaded.tokenizer("an opening beside").input_ids
    params = SamplingParams(temperature=temperature, seed=7)
    for d in (drafter, self_drafter):
        runs = {
            pipeline: speculative_generate(
                prompt, verifier, d, params, draft_length=3, max_new_tokens=24, pipeline=pipeline, opening="beside"
            )
            for pipeline in ("off", "bonus-match", "spec-cache")
        }
        tokens = {tuple(result.token_ids) for result in runs.values()}
        assert len(tokens) == 1
        for result in runs.values():
            assert result.records[0].target_only is TargetOnly.OPENING and result.records[0].draft_tokens == 0
            assert [t for r in result.records for t in r.committed] == result.token_ids
    if temperature == 0.0:
        ref = speculative_generate(prompt, verifier, None, params, draft_length=0, max_new_tokens=24).token_ids
        assert tokens == {tuple(ref)}
    assert runs["off"].stats.pipeline_hits > 0  # the target as its own draft guesses its first token


def test_the_in_process_loop_opens_as_the_coordinator_would(tiny) -> None:
    """Opening "auto" (the default) asks opening_for with the drafter's kind, as the coordinator's --opening
    auto does with its draft replicas': beside a model draft, draft-first with an n-gram draft. So the
    in-process oracle and the services emit the same tokens for a seed."""
    loaded, verifier, drafter, _ = tiny
    prompt = loaded.tokenizer("abc abc abc abc abc abc").input_ids
    params = SamplingParams(temperature=0.9, seed=3)
    model = speculative_generate(prompt, verifier, drafter, params, draft_length=3, max_new_tokens=12)
    assert model.records[0].target_only is TargetOnly.OPENING
    beside = speculative_generate(
        prompt, verifier, drafter, params, draft_length=3, max_new_tokens=12, opening="beside"
    )
    assert beside.token_ids == model.token_ids
    ngram = NgramDrafter(verifier.vocab_size)
    got = speculative_generate(prompt, verifier, ngram, GREEDY, draft_length=4, max_new_tokens=12)
    assert got.records[0].target_only is None and got.records[0].draft_tokens > 0  # draft-first
