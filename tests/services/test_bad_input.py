"""The public edge: malformed requests get INVALID_ARGUMENT with a helpful message; fuzzing finds no crash."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.cluster import Cluster

VOCAB = 259  # the tiny tokenizer's size (tiny_models.build_tiny_pair)
CONTEXT = 512


def req(**fields) -> coordinator_pb2.GenerateRequest:
    r = coordinator_pb2.GenerateRequest(max_new_tokens=2)
    sampling = fields.pop("sampling", {})
    speculation = fields.pop("speculation", {})
    chat = fields.pop("chat", None)
    token_ids = fields.pop("token_ids", None)
    for key, value in fields.items():
        if key in ("stop", "stop_token_ids"):
            getattr(r, key).extend(value)
        else:
            setattr(r, key, value)
    for key, value in sampling.items():
        setattr(r.sampling, key, value)
    for key, value in speculation.items():
        setattr(r.speculation, key, value)
    if chat is not None:
        r.chat.SetInParent()
        for role, content in chat:
            r.chat.messages.add(role=role, content=content)
    if token_ids is not None:
        r.token_ids.SetInParent()
        r.token_ids.ids.extend(token_ids)
    return r


FIXED = common_pb2.SpeculationParams.MODE_FIXED
AUTO = common_pb2.SpeculationParams.MODE_AUTO
MALFORMED = [
    (coordinator_pb2.GenerateRequest(max_new_tokens=2), "no prompt"),
    (req(text=""), "empty"),
    (req(token_ids=[]), "empty"),
    (req(token_ids=[VOCAB]), "outside the vocabulary"),
    (req(token_ids=[2**32 - 1]), "outside the vocabulary"),
    (req(token_ids=[1] * CONTEXT), "context"),
    (req(text="x", max_new_tokens=CONTEXT), "context"),
    (req(token_ids=[1] * 500, max_new_tokens=100), "at most 12 new tokens"),
    (req(text="x", max_new_tokens=10**6), "max_new_tokens"),
    (req(chat=[]), "no messages"),
    (req(chat=[("robot", "hi")]), "role"),
    (req(chat=[("", "hi")]), "role"),
    (req(chat=[("user", "ok"), ("admin", "hi")]), "role"),
    (req(text="x", sampling={"temperature": -1.0}), "temperature"),
    (req(text="x", sampling={"temperature": math.nan}), "temperature"),
    (req(text="x", sampling={"temperature": math.inf}), "temperature"),
    (req(text="x", sampling={"top_p": 0.0}), "top_p"),
    (req(text="x", sampling={"top_p": 1.5}), "top_p"),
    (req(text="x", sampling={"top_p": -0.1}), "top_p"),
    (req(text="x", sampling={"top_p": math.nan}), "top_p"),
    (req(text="x", sampling={"min_p": 1.0}), "min_p"),
    (req(text="x", sampling={"min_p": -0.5}), "min_p"),
    (req(text="x", sampling={"min_p": math.nan}), "min_p"),
    (req(text="x", sampling={"seed": 2**63}), "seed"),
    (req(text="x", stop=[f"s{i}" for i in range(17)]), "stop strings"),
    (req(text="x", stop=[""]), "stop strings"),
    (req(text="x", stop=["y" * 300]), "stop strings"),
    (req(text="x", stop_token_ids=[VOCAB + 5]), "stop token"),
    (req(text="x", speculation={"mode": FIXED, "draft_length": 100}), "draft_length"),
    (req(text="x", speculation={"mode": AUTO, "draft_length": 100}), "draft_length"),
    (req(text="x", speculation={"mode": 99}), "speculation mode"),
    (req(text="x" * 1_000_001), "characters"),
]


@pytest.fixture()
def stub(tiny_cluster: Cluster):
    with tiny_cluster.channel() as channel:
        yield coordinator_pb2_grpc.CoordinatorStub(channel)


@pytest.mark.parametrize("request_, needle", MALFORMED, ids=[n for _, n in MALFORMED])
def test_malformed_request_gets_invalid_argument(stub, request_, needle: str) -> None:
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request_, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert needle in err.value.details(), err.value.details()
    ok = stub.Generate(req(text="still serving", sampling={"temperature": 0.0}), timeout=30)
    assert len(ok.token_ids) == 2


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))
requests = st.fixed_dictionaries(
    {},
    optional={
        "text": st.text(max_size=30),
        "token_ids": st.lists(st.integers(0, 2**32 - 1) | st.integers(0, VOCAB - 1), max_size=8),
        "chat": st.lists(
            st.tuples(st.sampled_from(["user", "system", "assistant", "bot", ""]), st.text(max_size=10)), max_size=3
        ),
        "max_new_tokens": st.integers(0, 6) | st.integers(0, 2**32 - 1),
        "stop": st.lists(st.text(max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=2),
        "ignore_eos": st.booleans(),
        "sampling": st.fixed_dictionaries(
            {},
            optional={
                "temperature": floats,
                "top_p": floats,
                "min_p": floats,
                "top_k": st.integers(0, 2**32 - 1),
                "seed": st.integers(0, 2**64 - 1),
            },
        ),
        "speculation": st.fixed_dictionaries(
            {}, optional={"mode": st.integers(0, 5), "draft_length": st.integers(0, 40)}
        ),
    },
)


@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(fields=requests)
def test_fuzzed_requests_never_crash(stub, fields) -> None:
    if "text" in fields and ("token_ids" in fields or "chat" in fields):
        fields.pop("token_ids", None)
        fields.pop("chat", None)
    if fields.get("max_new_tokens", 0) > 6:
        fields["max_new_tokens"] = (
            fields["max_new_tokens"] % 7 if fields["max_new_tokens"] < 10**6 else fields["max_new_tokens"]
        )
    try:
        reply = stub.Generate(req(**fields), timeout=60)
        assert len(reply.token_ids) <= max(fields.get("max_new_tokens", 0), 128)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
            err.code(),
            err.details(),
            fields,
        )
        assert err.details() and "internal" not in err.details().lower()
