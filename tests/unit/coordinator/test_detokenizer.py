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


@pytest.mark.parametrize("text", ["\ufffd", "a\ufffd", "\ufffd\ufffd b"])
def test_a_replacement_character_in_the_text_is_released_at_the_end(tok, text: str) -> None:
    # U+FFFD is also what an incomplete character decodes to: held back while it may complete,
    # released when the output ends (hypothesis found the lone one lost).
    for step in (1, 2):
        whole, _, _ = stream(tok, "prefix ", text, step=step)
        assert whole == text


def test_an_output_that_ends_inside_a_character_ends_with_a_replacement_character(tok) -> None:
    ids = tok("é", add_special_tokens=False).input_ids
    assert len(ids) == 2  # two UTF-8 bytes, one token each (byte-level tokenizer)
    d = IncrementalDetokenizer(tok, [], ())
    d.push(ids[:1])
    assert d.take() == ""
    assert d.take(final=True) == "\ufffd"  # as the whole output decodes


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


def counted(d: IncrementalDetokenizer) -> list[int]:
    """Wrap d's decoder to record how many ids each call decodes."""
    sizes: list[int] = []
    decode = d._decode

    def counting(ids: list[int]) -> str:
        sizes.append(len(ids))
        return decode(ids)

    d._decode = counting
    return sizes


@pytest.mark.parametrize("step", [1, 4])
def test_work_per_token_is_flat_over_tokens_that_never_complete_a_character(tok, step: int) -> None:
    """4,096 lone continuation bytes (each decodes to U+FFFD alone): the ids decoded per token do not grow."""
    lone = 0x80  # the tiny tokenizer's id == byte: a lone continuation byte
    assert tok.decode([lone]) == "\ufffd"
    d = IncrementalDetokenizer(tok, tok("prompt ", add_special_tokens=False).input_ids)
    sizes = counted(d)
    per_block, pieces = [], []
    for _block in range(4):
        before = sum(sizes)
        for _ in range(0, 1024, step):
            assert d.push([lone] * step) is None
            pieces.append(d.take())
        per_block.append(sum(sizes) - before)
    d.push(tok("a", add_special_tokens=False).input_ids)  # a whole character releases what still waits
    pieces.append(d.take(final=True))
    assert "".join(pieces) == "\ufffd" * 4096 + "a"
    assert per_block[-1] <= 2 * per_block[0], per_block
    assert per_block[0] <= 1024 * 100  # a bounded window, not the whole run


def test_streamed_text_equals_whole_text_for_any_bytes(tok) -> None:
    """Runs of invalid bytes longer than the wait bound, with valid characters around them and split across it."""

    def ids_of(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    lone, lead = 0x80, ids_of("世")[:1]  # a lone continuation byte; a lead byte
    for run in (1, 15, 16, 17, 40, 63, 64, 65, 200):
        for ids in (
            ids_of("a") + [lone] * run + ids_of("世界 b"),
            [lone] * run + lead + [lone] + ids_of("é"),
            lead * run + ids_of("🎉"),
        ):
            d = IncrementalDetokenizer(tok, ids_of("p "))
            pieces = []
            for t in ids:
                d.push([t])
                pieces.append(d.take())
            pieces.append(d.take(final=True))
            assert "".join(pieces) == tok.decode(ids), (run, ids)


def test_a_long_run_of_special_tokens_keeps_the_context(tok) -> None:
    """Tokens with no text past the wait bound are dropped, not used as context."""
    special = tok.convert_tokens_to_ids(tok.all_special_tokens[0])
    d = IncrementalDetokenizer(tok, tok("p ", add_special_tokens=False).input_ids)
    sizes = counted(d)
    text = []
    for _ in range(1000):
        d.push([special])
        text.append(d.take())
    d.push(tok(" ok", add_special_tokens=False).input_ids)
    text.append(d.take(final=True))
    assert "".join(text) == " ok"
    assert max(sizes) <= 2 * 16 + 8  # the context and at most the wait bound of pending tokens, not 1,000


@settings(max_examples=100, deadline=None)
@given(
    raw=st.lists(st.sampled_from([0x80, 0xBF, 0xE4, 0xB8, 0x96, 0xF0, 0x9F, 0xC3, ord("a"), ord(" ")]), max_size=120),
    step=st.integers(1, 4),
)
def test_streamed_bytes_equal_their_whole_decode(tok, raw: list[int], step: int) -> None:
    """Any byte sequence (the tiny tokenizer's id == byte) streams to the text of decoding it whole."""
    ids = [*raw, ord("a")]  # end on a whole character: a trailing undecided one is never released
    d = IncrementalDetokenizer(tok, tok("p ", add_special_tokens=False).input_ids)
    pieces = []
    for i in range(0, len(ids), step):
        d.push(ids[i : i + step])
        pieces.append(d.take())
    pieces.append(d.take(final=True))
    assert "".join(pieces) == tok.decode(ids)
