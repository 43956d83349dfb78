"""CausalLMRunner: cached logits equal a no-cache forward after any edit sequence."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from tests.devices import DEVICE

# Max abs difference allowed between cached and no-cache logits. A cached pass reduces in another
# order than a full one, and the kernels chosen differ per CPU (CI's reached 1.04e-5 where this
# machine stays under 1e-5); a wrong cache position or a stale KV row differs by 0.1 or more.
TOL = 5e-5
# Max abs difference allowed between the same walk's logits on SPECD_TEST_DEVICE and on the CPU
# (float32 both; a GPU's kernels reduce in their own order). A broken cache on one side differs
# by 0.1 or more, as above.
DEVICE_TOL = 2e-4


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def runner(request: pytest.FixtureRequest, tiny_pair: tuple[Path, Path], tiny_gpt2_dir: Path) -> CausalLMRunner:
    """On SPECD_TEST_DEVICE (the tests marked `device` use it there)."""
    path = tiny_pair[0] if request.param == "llama" else tiny_gpt2_dir
    return CausalLMRunner(load_pretrained(path).model.to(DEVICE))


@pytest.fixture(scope="module")
def llama_runner(tiny_pair: tuple[Path, Path]) -> CausalLMRunner:
    return CausalLMRunner(load_pretrained(tiny_pair[0]).model)


@torch.inference_mode()
def reference(r: CausalLMRunner, tokens: list[int], num_last: int) -> Tensor:
    """Logits of the last num_last positions from a fresh full forward, no cache -> [num_last, V]."""
    out = r.model(input_ids=torch.tensor([tokens], device=r.model.device), use_cache=False)
    return out.logits[0, -num_last:].float()


def check(r: CausalLMRunner, s: KVSession, num_last: int = 1) -> Tensor:
    """r.logits(s, num_last) matches the reference; returns it."""
    got = r.logits(s, num_last)
    want = reference(r, s.tokens, num_last)
    assert got.shape == (num_last, r.vocab_size)
    assert got.dtype == torch.float32
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"cached logits differ from a full forward by {diff:.3g} (len {len(s.tokens)})"
    assert s.cached == len(s.tokens)
    return got


def random_ids(rng: random.Random, r: CausalLMRunner, n: int) -> list[int]:
    return [rng.randrange(r.vocab_size) for _ in range(n)]


# ---- the speculative round, step by step ----------------------------------------


@pytest.mark.device
def test_prefill_decode_verify_rollback(runner: CausalLMRunner) -> None:
    r = runner
    rng = random.Random(1)
    s = r.new_session(random_ids(rng, r, 9))
    assert s.cached == 0  # lazy: nothing computed yet
    check(r, s)  # prefill
    for _ in range(3):  # decode: append the greedy token, read the next distribution
        nxt = int(r.logits(s)[-1].argmax())
        r.append(s, [nxt])
        check(r, s)
    committed = len(s.tokens)
    drafts = random_ids(rng, r, 4)
    r.append(s, drafts)
    check(r, s, num_last=len(drafts) + 1)  # verify K drafts: K + 1 distributions
    r.truncate(s, committed + 2)  # accepted 1 draft, then the recovered token replaces #2
    assert s.cached == committed + 2
    r.append(s, random_ids(rng, r, 1))
    check(r, s)
    r.append(s, random_ids(rng, r, 3))  # next round's verify
    check(r, s, num_last=4)


@pytest.mark.device
def test_rollback_to_one_token_and_reverify(runner: CausalLMRunner) -> None:
    r = runner
    rng = random.Random(2)
    s = r.new_session(random_ids(rng, r, 12))
    check(r, s, num_last=12)  # every position of a fresh prefill
    r.truncate(s, 1)
    assert s.tokens == s.tokens[:1] and s.cached == 1
    check(r, s)
    r.append(s, random_ids(rng, r, 5))
    check(r, s, num_last=6)  # re-verify after rollback
    r.truncate(s, 3)
    check(r, s, num_last=3)  # all three recomputed (fewer uncached than asked)
    check(r, s, num_last=2)  # fully cached: recompute just the last two


@pytest.mark.device
def test_splice_from_the_start_keeps_common_prefix(runner: CausalLMRunner) -> None:
    r = runner
    rng = random.Random(3)
    base = random_ids(rng, r, 10)
    s = r.new_session(base)
    check(r, s)
    other = base[:6] + random_ids(rng, r, 5)
    other[6] = (base[6] + 1) % r.vocab_size  # diverge exactly at position 6
    r.splice(s, 0, other)
    assert s.tokens == other and s.cached == 6
    check(r, s, num_last=3)
    r.splice(s, 0, other[:4])  # a pure prefix: cache kept up to it
    assert s.cached == 4
    check(r, s)
    r.splice(s, 0, other[:4] + base[4:])  # grow back
    assert s.cached == 4
    check(r, s, num_last=7)


@pytest.mark.device
def test_splice_keeps_the_cache_of_the_common_prefix(runner: CausalLMRunner) -> None:
    r = runner
    rng = random.Random(5)
    base = random_ids(rng, r, 10)
    s = r.new_session(base)
    check(r, s)
    r.splice(s, 6, base[6:8] + [(base[8] + 1) % r.vocab_size])  # agrees up to 8, diverges at 8
    assert s.tokens == base[:8] + [(base[8] + 1) % r.vocab_size] and s.cached == 8
    check(r, s, num_last=2)
    r.splice(s, 4, [])  # a pure prefix
    assert s.tokens == base[:4] and s.cached == 4
    with pytest.raises(InvalidArgument, match="start must be"):
        r.splice(s, 5, [1])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        r.splice(s, 2, [r.vocab_size])
    with pytest.raises(InvalidArgument, match="empty"):
        r.splice(s, 0, [])
    assert s.tokens == base[:4]  # a refused splice changes nothing


@pytest.mark.device
def test_random_walk_matches_full_forward(runner: CausalLMRunner) -> None:
    """Seeded random sequences of every edit; each logits call checked against a full forward."""
    r = runner
    for seed in range(4):
        rng = random.Random(seed)
        s = r.new_session(random_ids(rng, r, rng.randint(1, 8)))
        checks = 0
        for _ in range(40):
            op = rng.choice(["append", "append", "truncate", "replace", "splice", "logits", "logits"])
            n = len(s.tokens)
            if op == "append" and n < 90:
                r.append(s, random_ids(rng, r, rng.randint(0, 6)))
            elif op == "truncate":
                r.truncate(s, rng.randint(1, n))
            elif op == "replace":
                keep = rng.randint(0, n)
                r.splice(s, 0, s.tokens[:keep] + random_ids(rng, r, rng.randint(1 if keep == 0 else 0, 5)))
            elif op == "splice":
                keep = rng.randint(0, n)
                # Sometimes a tail that repeats what follows `keep` (the cache of that part stays).
                tail = s.tokens[keep : keep + rng.randint(0, 3)] + random_ids(
                    rng, r, rng.randint(1 if keep == 0 else 0, 4)
                )
                want = s.tokens[:keep] + tail
                r.splice(s, keep, tail)
                assert s.tokens == want
            else:
                check(r, s, num_last=rng.randint(1, min(len(s.tokens), 8)))
                checks += 1
        check(r, s, num_last=min(len(s.tokens), 5))
        assert checks > 5


@pytest.mark.device
def test_sessions_are_independent(runner: CausalLMRunner) -> None:
    r = runner
    rng = random.Random(4)
    a = r.new_session(random_ids(rng, r, 7))
    b = r.new_session(random_ids(rng, r, 5))
    for _ in range(3):
        check(r, a, 2)
        r.append(a, random_ids(rng, r, 2))
        check(r, b)
        r.append(b, random_ids(rng, r, 1))
        r.truncate(a, len(a.tokens) - 1)


@pytest.mark.device
def test_device_logits_match_the_cpu(runner: CausalLMRunner, tiny_pair: tuple[Path, Path], tiny_gpt2_dir: Path) -> None:
    """One walk of decode, verify and rollback on SPECD_TEST_DEVICE and on the CPU: the same logits."""
    path = tiny_pair[0] if runner.model.config.model_type == "llama" else tiny_gpt2_dir
    cpu = CausalLMRunner(load_pretrained(path).model)
    rng = random.Random(6)
    prompt = random_ids(rng, runner, 11)
    s, c = runner.new_session(prompt), cpu.new_session(prompt)
    for step in range(12):
        k = rng.randint(1, 5)
        drafts = random_ids(rng, runner, k)
        runner.append(s, drafts)
        cpu.append(c, drafts)
        got, want = runner.logits(s, k + 1), cpu.logits(c, k + 1)  # a verify of k drafts
        assert got.device.type == DEVICE.type
        diff = (got.cpu() - want).abs().max().item()
        assert diff <= DEVICE_TOL, f"step {step}: {DEVICE} logits differ from the CPU's by {diff:.3g}"
        keep = len(s.tokens) - k + rng.randint(0, k)  # accept some drafts, roll back the rest
        runner.truncate(s, keep)
        cpu.truncate(c, keep)
        assert s.tokens == c.tokens and s.cached == c.cached


# ---- the cache is used, not bypassed ------------------------------------------------


def test_forward_runs_only_uncached_tokens(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    seen: list[tuple[int, int]] = []  # (input length, first position) per forward

    def spy(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        seen.append((kwargs["input_ids"].shape[1], int(kwargs["position_ids"][0, 0])))

    handle = r.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        s = r.new_session(list(range(10)))
        r.logits(s)
        r.append(s, [1])
        r.logits(s)
        r.append(s, [2, 3, 4])
        r.logits(s, num_last=4)  # verify 3 drafts: 4 rows need positions 10..13; 10 is recomputed
        r.logits(s, num_last=1)  # nothing new: recompute the last position only
        r.truncate(s, 5)
        r.logits(s, num_last=2)
    finally:
        handle.remove()
    assert seen == [(10, 0), (1, 10), (4, 10), (1, 13), (2, 3)]


def test_kv_bytes_tracks_cached_length(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    cfg = r.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    s = r.new_session(list(range(20)))
    assert r.kv_bytes(s) == 0
    r.logits(s)
    assert r.kv_bytes(s) == 20 * per_token
    r.truncate(s, 7)
    assert r.kv_bytes(s) == 7 * per_token


def test_failed_forward_leaves_session_usable(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    s = r.new_session(list(range(8)))
    check(r, s)
    r.append(s, [9, 10, 11])

    def boom(*_: object) -> None:
        raise RuntimeError("injected failure in layer 2")

    handle = r.model.model.layers[2].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            r.logits(s)
    finally:
        handle.remove()
    # layers 0 and 1 had appended keys for the new tokens; they were cropped back
    assert {layer.get_seq_length() for layer in s.cache.layers} == {s.cached}
    check(r, s, num_last=3)


# ---- validation ------------------------------------------------------------------


def test_vocab_size_is_logits_width(runner: CausalLMRunner) -> None:
    assert runner.vocab_size == runner.model.get_output_embeddings().weight.shape[0] == 259
    assert runner.max_context == 512


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "empty"),
        ([1, 259], r"token_ids\[1\] = 259 is outside the vocabulary \[0, 259\)"),
        ([-1], r"token_ids\[0\] = -1 is outside the vocabulary"),
        ([1, 2.0], r"token_ids\[1\] is float"),
        ([True], "bool"),
        ("hello", "not text"),
    ],
)
def test_new_session_rejects_bad_ids(llama_runner: CausalLMRunner, ids: list, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        llama_runner.new_session(ids)


def test_context_limit(tiny_pair: tuple[Path, Path]) -> None:
    model = load_pretrained(tiny_pair[0]).model
    r = CausalLMRunner(model, max_context=16)
    assert r.max_context == 16
    with pytest.raises(InvalidArgument, match="would be 17 tokens, more than the context of 16; shorten it by 1"):
        r.new_session([0] * 17)
    s = r.new_session([0] * 14)
    with pytest.raises(InvalidArgument, match="would be 18 tokens"):
        r.append(s, [1, 2, 3, 4])
    assert len(s.tokens) == 14  # a rejected append changes nothing
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        r.append(s, [1, 999])
    assert len(s.tokens) == 14
    with pytest.raises(InvalidArgument, match="would be 20 tokens"):
        r.splice(s, 0, [0] * 20)
    with pytest.raises(InvalidArgument, match="exceeds the model's 512 positions"):
        CausalLMRunner(model, max_context=513)
    with pytest.raises(InvalidArgument, match="max_context must be >= 1"):
        CausalLMRunner(model, max_context=0)


def test_bad_truncate_and_num_last(llama_runner: CausalLMRunner) -> None:
    r = llama_runner
    s = r.new_session([5, 6, 7])
    for length in (0, 4, -1):
        with pytest.raises(InvalidArgument, match=r"length must be in \[1, 3\]"):
            r.truncate(s, length)
    for num_last in (0, 4):
        with pytest.raises(InvalidArgument, match=r"num_last must be an int in \[1, 3\]"):
            r.logits(s, num_last)
    with pytest.raises(InvalidArgument, match="empty"):
        r.splice(s, 0, [])
    assert s.tokens == [5, 6, 7]
