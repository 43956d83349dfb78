"""OpenAI bodies -> GenerateRequest, and Chunks -> OpenAI objects (coordinator.openai_api), without processes."""

from __future__ import annotations

import json

import grpc
import pytest

from coordinator import openai_api as oa
from coordinator.engine import Chunk
from coordinator.requests import prompt_chars_limit, public_body_limit, public_message_limit
from specd.core import errors
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.record import RequestStats, RoundStats
from specd.serving.config import CoordinatorConfig
from specd.serving.grpc_errors import http_status_for
from specd.v1 import common_pb2

MODELS = ["tiny", "alias"]


def _stats() -> RequestStats:
    rounds = RoundStats(rounds=3, drafts=2, draft_tokens=8, accepted_tokens=6)
    return RequestStats(
        rounds=rounds, prompt_tokens=5, completion_tokens=9, time_to_first_token_ms=2.0, tokens_per_s=100.0, seed=7
    )


def test_a_completion_body_becomes_the_grpc_request() -> None:
    parsed = oa.parse_completion(
        {
            "model": "alias",
            "prompt": "hello",
            "max_tokens": 12,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": "\n",
            "seed": 3,
            "n": 1,
            "user": "someone",
            "top_k": 40,
            "min_p": 0.05,
            "ignore_eos": True,
            "stop_token_ids": [2, 5],
            "cache_salt": "s3cret",
            "speculation": "fixed",
            "draft_length": 6,
            "pipeline": "post-verify",
        },
        MODELS,
    )
    r = parsed.request
    assert parsed.kind == oa.COMPLETION and parsed.model == "alias" and not parsed.stream
    assert r.text == "hello" and r.max_new_tokens == 12
    assert r.sampling.temperature == pytest.approx(0.7) and r.sampling.top_p == pytest.approx(0.9)
    assert r.sampling.top_k == 40 and r.sampling.min_p == pytest.approx(0.05) and r.sampling.seed == 3
    assert list(r.stop) == ["\n"] and list(r.stop_token_ids) == [2, 5] and r.ignore_eos
    assert r.cache_salt == "s3cret"
    assert r.speculation.mode == common_pb2.SpeculationParams.MODE_FIXED and r.speculation.draft_length == 6
    assert r.speculation.pipeline == common_pb2.SpeculationParams.PIPELINE_POST_VERIFY


def test_completion_defaults_follow_openai() -> None:
    r = oa.parse_completion({"prompt": "x"}, MODELS)
    assert r.model == "tiny" and r.request.max_new_tokens == 16  # OpenAI's default for completions
    assert not r.request.sampling.HasField("temperature") and not r.request.sampling.HasField("seed")
    assert r.request.speculation.mode == common_pb2.SpeculationParams.MODE_UNSPECIFIED


@pytest.mark.parametrize(
    ("prompt", "field", "value"),
    [(["only one"], "text", "only one"), ([1, 2, 3], "token_ids", [1, 2, 3]), ([[4, 5]], "token_ids", [4, 5])],
)
def test_prompt_forms(prompt, field, value) -> None:
    r = oa.parse_completion({"prompt": prompt}, MODELS).request
    assert r.WhichOneof("prompt") == field
    assert (r.text if field == "text" else list(r.token_ids.ids)) == value


def test_a_chat_body_becomes_chat_messages() -> None:
    parsed = oa.parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_tokens": 50,
            "max_completion_tokens": 20,
            "stop": ["a", "b"],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        MODELS,
    )
    msgs = [(m.role, m.content) for m in parsed.request.chat.messages]
    assert msgs == [("system", "be brief"), ("user", "hi there")]
    assert parsed.request.max_new_tokens == 20  # max_completion_tokens wins, as in OpenAI's API
    assert parsed.stream and parsed.include_usage and list(parsed.request.stop) == ["a", "b"]
    assert oa.parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODELS).request.max_new_tokens == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "speculation": "always"}, "speculation"),
        ({"prompt": "x", "pipeline": "fast"}, "pipeline"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"]}, None),
    ],
)
def test_bad_completion_params_are_400_naming_the_field(body, param) -> None:
    with pytest.raises(oa.BadParam) as err:
        oa.parse_completion(body, MODELS)
    assert err.value.param == param
    status, code, message = http_status_for(err.value)
    assert (status, code) == (400, grpc.StatusCode.INVALID_ARGUMENT) and message == str(err.value)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_chat_params(body, param) -> None:
    with pytest.raises(oa.BadParam) as err:
        oa.parse_chat(body, MODELS)
    assert err.value.param == param


def test_unused_values_of_unsupported_features_pass() -> None:
    oa.parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "top_k": -1,
        },
        MODELS,
    )


def test_whole_response_objects() -> None:
    done = oa.Completion()
    done.add(Chunk([1, 2], "he"))
    done.add(Chunk([3], "llo", FinishReason.STOP_STRING, _stats()))
    comp = oa.parse_completion({"prompt": "x", "return_token_ids": True}, MODELS)
    body = oa.response(comp, done)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    assert body["choices"] == [
        {"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop", "token_ids": [1, 2, 3]}
    ]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 9, 14)
    assert usage["draft_tokens"] == 8 and usage["accepted_tokens"] == 6 and usage["acceptance_rate"] == 0.75
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2}
    assert body["specd"]["acceptance_length"] == 4.0 and body["specd"]["seed"] == 7
    json.dumps(body)  # plain JSON

    chat = oa.parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODELS)
    body = oa.response(chat, done)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert "token_ids" not in body["choices"][0]


def test_length_and_context_are_length() -> None:
    assert oa.FINISH_REASONS[FinishReason.LENGTH] == oa.FINISH_REASONS[FinishReason.CONTEXT_FULL] == "length"
    assert oa.FINISH_REASONS[FinishReason.STOP_TOKEN] == "stop"


def test_stream_chunks() -> None:
    chat = oa.parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"include_usage": True}},
        MODELS,
    )
    opening = oa.stream_chunk(chat, None, first=True)
    assert opening is not None and opening["object"] == "chat.completion.chunk"
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""} and opening["usage"] is None
    assert oa.stream_chunk(chat, Chunk([9], "")) is None  # text held back: nothing to send
    mid = oa.stream_chunk(chat, Chunk([1], "a"))
    assert mid is not None and mid["choices"][0]["delta"] == {"content": "a"}
    last = oa.stream_chunk(chat, Chunk([2], "", FinishReason.LENGTH, _stats()))
    assert last is not None and last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert last["specd"]["draft_tokens"] == 8
    tail = oa.usage_chunk(chat, _stats())
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 14

    comp = oa.parse_completion({"prompt": "x", "stream": True}, MODELS)
    assert oa.stream_chunk(comp, None, first=True) is None  # completions open with text
    event = oa.stream_chunk(comp, Chunk([1], "a"))
    assert event is not None and event["choices"][0]["text"] == "a" and "usage" not in event


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (errors.InvalidArgument("x"), 400),
        (errors.ResourceExhausted("full"), 429),
        (errors.Unavailable("peer 10.0.0.1 down"), 503),
        (errors.DeadlineExceeded("late"), 504),
        (errors.Internal("secret detail"), 500),
        (RuntimeError("boom"), 500),
    ],
)
def test_the_one_mapper_gives_http_statuses(exc, status) -> None:
    got, _, message = http_status_for(exc)
    assert got == status
    if status >= 500:  # internals are logged, not sent
        assert "10.0.0.1" not in message and "secret" not in message and "boom" not in message


def test_error_body_is_openais_shape() -> None:
    body = oa.error_body(429, "full", code="resource_exhausted")
    assert body == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "resource_exhausted"}
    }


def test_models_list() -> None:
    body = oa.models_list(MODELS, created=1, max_context=512)
    assert [m["id"] for m in body["data"]] == MODELS and body["data"][0]["max_model_len"] == 512


# ---- settings ---------------------------------------------------------------------------------


def test_http_port_settings(tmp_path) -> None:
    CoordinatorConfig(http_port=-1).validate()
    CoordinatorConfig(http_port=0).validate()
    with pytest.raises(errors.InvalidArgument, match="--http-port"):
        CoordinatorConfig(http_port=70000).validate()
    assert CoordinatorConfig(served_model_name="a, b").served_model_names == ["a", "b"]
    # Client certificate names cannot be checked on the HTTP port: refused together, not ignored.
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_text("x")
    mtls = {"tls_cert": str(tmp_path / "cert"), "tls_key": str(tmp_path / "key"), "tls_client_ca": str(tmp_path / "ca")}
    CoordinatorConfig(http_port=0, **mtls).validate()
    with pytest.raises(errors.InvalidArgument, match="--tls-client-names"):
        CoordinatorConfig(http_port=0, tls_client_names="coordinator", **mtls).validate()


def test_the_body_limit_is_the_grpc_message_limit_with_json_escapes() -> None:
    config = CoordinatorConfig()
    chars = prompt_chars_limit(config, 512)
    assert public_body_limit(config, 512) - public_message_limit(config, 512) == 2 * chars
    assert public_body_limit(config, 512) >= 6 * chars  # a prompt at the character limit, every character escaped
