"""Incremental detokenization: multi-byte characters, merges, stop strings, hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from coordinator.detokenizer import IncrementalDetokenizer
from specd.tools.tiny_models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def stream(tok, prompt: str, text: str, stops=(), step: int = 1) -> tuple[str, list[str], int | None]:
    ids = tok(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, tok(prompt, add_special_tokens=False).input_ids, stops)
    pieces = []
    kept = None
    for i in range(0, len(ids), step):
        keep = d.push(ids[i : i + step])
        pieces.append(d.take())
        if keep is not None:
            kept = i + keep
            break
    pieces.append(d.take(final=True))
    return "".join(pieces), pieces, kept


@settings(max_examples=150, deadline=None)
@given(text=st.text(min_size=1, max_size=40).filter(lambda t: "<|" not in t), step=st.integers(1, 4))
def test_streamed_text_equals_whole_text(tok, text: str, step: int) -> None:
    whole, pieces, _ = stream(tok, "prefix ", text, step=step)
    assert whole == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_multibyte_characters_are_held_until_complete(tok) -> None:
    _, pieces, _ = stream(tok, "", "héllo 世界 🎉")
    assert "".join(pieces) == "héllo 世界 🎉"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens completed no character yet


def test_stop_string_is_cut_and_never_streamed(tok) -> None:
    whole, pieces, kept = stream(tok, "", "The answer is 42.\n\nQuestion: next", stops=["\n\nQuestion"])
    assert whole == "The answer is 42."
    assert kept is not None and kept == len(tok("The answer is 42.\n\nQuestion").input_ids)
    assert not any("Question" in p for p in pieces)


def test_earliest_of_several_stop_strings_wins(tok) -> None:
    whole, _, _ = stream(tok, "", "abc STOP def END", stops=["END", "STOP"], step=3)
    assert whole == "abc "


def test_text_that_only_might_become_a_stop_string_is_released_at_the_end(tok) -> None:
    whole, pieces, kept = stream(tok, "", "done. ST", stops=["STOP"])
    assert kept is None and whole == "done. ST"
    assert not pieces[-2].endswith("ST")  # held back while it could still be "STOP"


def test_demo_tokenizer_merged_tokens(demo_target_dir) -> None:
    demo = AutoTokenizer.from_pretrained(demo_target_dir)
    text = " Hello, world! naïve café — 日本語 🎉 def f(x):\n    return x"
    whole, pieces, _ = stream(demo, "Say:", text)
    assert whole == text
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab STOP\n", min_size=1, max_size=40),
    stops=st.lists(st.sampled_from(["STOP", "\n\n", "b a", "TO"]), max_size=2),
    step=st.integers(2, 6),
)
def test_a_rounds_tokens_pushed_together_stop_where_one_at_a_time_would(tok, text: str, stops, step: int) -> None:
    """The multi-token fast path cuts at the same token and keeps the same text as pushing one by one."""
    one = stream(tok, "p ", text, stops=stops, step=1)
    many = stream(tok, "p ", text, stops=stops, step=step)
    assert many[0] == one[0] and many[2] == one[2]
