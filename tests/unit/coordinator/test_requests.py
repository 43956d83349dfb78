"""The draft length a request asks for, as the coordinator reads it (no services: tests/services/test_bad_input.py)."""

from __future__ import annotations

import pytest

from coordinator.requests import spec_from_prompt
from specd.core.errors import InvalidArgument
from specd.serving.config import CoordinatorConfig
from specd.v1 import common_pb2, coordinator_pb2

VOCAB = 259  # the tiny tokenizer's size (tiny_models.build_tiny_pair)
FIXED = common_pb2.SpeculationParams.MODE_FIXED
AUTO = common_pb2.SpeculationParams.MODE_AUTO


@pytest.mark.parametrize("mode, asked, expected", [(AUTO, 12, 12), (AUTO, 0, 4), (FIXED, 6, 6), (FIXED, 0, 4)])
def test_draft_length_is_fixed_k_or_autos_largest_k(mode: int, asked: int, expected: int) -> None:
    r = coordinator_pb2.GenerateRequest(max_new_tokens=2)
    r.token_ids.ids.extend([1, 2, 3])
    r.speculation.mode, r.speculation.draft_length = mode, asked
    spec = spec_from_prompt(
        r, [1, 2, 3], CoordinatorConfig(), vocab_size=VOCAB, max_context=100, eos_token_ids=frozenset()
    )
    assert spec.draft_length == expected  # 0: the server's --draft-length (4)


def _spec(salt: str, identity: str):
    r = coordinator_pb2.GenerateRequest(max_new_tokens=2, cache_salt=salt)
    r.token_ids.ids.extend([1, 2, 3])
    return spec_from_prompt(
        r,
        [1, 2, 3],
        CoordinatorConfig(),
        vocab_size=VOCAB,
        max_context=100,
        eos_token_ids=frozenset(),
        identity=identity,
    )


def test_the_tenant_is_the_callers_identity_narrowed_by_its_cache_salt() -> None:
    assert _spec("", "").tenant == ""  # anonymous, no salt: learns nothing across requests
    keys = {_spec(s, i).tenant for s in ("", "a", "b") for i in ("", "cert:alice", "cert:bob")} - {""}
    assert len(keys) == 8  # every other (identity, salt) pair its own tenant
    assert _spec("a", "cert:alice").tenant == _spec("a", "cert:alice").tenant
    assert "alice" not in _spec("a", "cert:alice").tenant  # an opaque key: neither name nor salt travels
    with pytest.raises(InvalidArgument, match="cache_salt has 257 characters"):
        _spec("x" * 257, "")
