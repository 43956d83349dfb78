"""OpenAI's completions and chat completions <-> specd's GenerateRequest and Chunks: translation only.

A body becomes the same GenerateRequest a gRPC caller would send, so it meets
the same validation, admission, deadline and engine (coordinator.calls); the
chunks come back as OpenAI's objects. What this module checks is only what
the translation needs: each field's JSON type, and the OpenAI features specd
does not have (n > 1, logprobs, tools, penalties...), refused with 400 rather
than silently ignored. Value ranges (temperature, top_p, max_tokens against
the context) are the engine's, with its messages.

Parameters, by OpenAI's names: model, prompt / messages, max_tokens (chat:
max_completion_tokens too), temperature, top_p, stop, seed, n (1), stream,
stream_options.include_usage, user (accepted, not used: it is the caller's
claim, not a proven identity, so it cannot scope what the draft learns).
Extra body fields, by vLLM's names where vLLM has one: top_k, min_p,
ignore_eos, stop_token_ids, cache_salt, return_token_ids (repetition_penalty
1 and min_tokens 0 only); specd's own: speculation (auto|fixed|off),
draft_length, pipeline (off|bonus-match|post-verify|spec-cache|auto).

Speculation numbers come back in `usage` (draft_tokens, accepted_tokens,
acceptance_rate, acceptance_length, and OpenAI's
completion_tokens_details.accepted/rejected_prediction_tokens) and, all of
them, under a `specd` key (the stats `specd generate --json` prints).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict

from coordinator.engine import Chunk, RequestStats
from specd.core.errors import InvalidArgument
from specd.core.rounds.generation import FinishReason
from specd.serving.wire import stats_to_proto
from specd.v1 import common_pb2, coordinator_pb2

COMPLETION = "text_completion"
CHAT = "chat.completion"
UINT32_MAX = 2**32 - 1

# OpenAI's finish reasons: a stop sequence or the end of the text is "stop", a length cap is "length".
FINISH_REASONS = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_FULL: "length",
}
_MODES = {
    "auto": common_pb2.SpeculationParams.MODE_AUTO,
    "fixed": common_pb2.SpeculationParams.MODE_FIXED,
    "off": common_pb2.SpeculationParams.MODE_OFF,
}
_PIPELINES = {
    "off": common_pb2.SpeculationParams.PIPELINE_OFF,
    "bonus-match": common_pb2.SpeculationParams.PIPELINE_BONUS_MATCH,
    "post-verify": common_pb2.SpeculationParams.PIPELINE_POST_VERIFY,
    "spec-cache": common_pb2.SpeculationParams.PIPELINE_SPEC_CACHE,
    "auto": common_pb2.SpeculationParams.PIPELINE_AUTO,
}
# OpenAI's chat roles; "developer" is its newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Features specd does not have, and each one's value that means "not used".
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {"echo": (None, False), "suffix": (None, "")}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "top_logprobs": (None, 0),
    "audio": (None,),
    "prediction": (None,),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
}
# Error "type" by HTTP status, as OpenAI's API names them (its clients read the status).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class BadParam(InvalidArgument):
    """An InvalidArgument that names the body field to fix (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OpenAIRequest:
    """A translated body: the GenerateRequest and how to answer (object kind, stream, usage)."""

    kind: str  # COMPLETION or CHAT
    request: coordinator_pb2.GenerateRequest
    model: str  # the name to answer with: the one asked for, or the first served name
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == COMPLETION else "chatcmpl-") + self.id


# ---- body -> GenerateRequest ------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _int(body: Mapping[str, Any], name: str, lo: int = 0, hi: int = UINT32_MAX) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise BadParam(f"{name} must be an integer (got {type(v).__name__})", name)
    if not lo <= v <= hi:
        raise BadParam(f"{name} must be in {lo}..{hi} (got {v})", name)
    return int(v)


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v):
        raise BadParam(f"{name} must be a finite number", name)
    return float(v)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadParam(f"{name} must be true or false", name)
    return v


def _str(body: Mapping[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadParam(f"{name} must be a string", name)
    return v


def _refuse_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]]) -> None:
    """400 for a feature specd does not have, unless its value is one that means "not used"."""
    for name, unused in table.items():
        value = body.get(name)
        if not any(value == u and isinstance(value, bool) == isinstance(u, bool) for u in unused):
            raise BadParam(f"{name} is not supported by specd; leave it out", name)


def _model(body: Mapping[str, Any], models: Sequence[str]) -> str:
    name = _str(body, "model")
    if not name:
        return models[0]
    if name not in models:
        raise BadParam(f"the model {name!r} is not served here; use {models[0]!r} (GET /v1/models)", "model")
    return name


def _common(body: Mapping[str, Any], req: coordinator_pb2.GenerateRequest) -> tuple[bool, bool]:
    """The fields completions and chat share, into req; returns (stream, include_usage)."""
    n = _int(body, "n", 1, UINT32_MAX)
    if n is not None and n != 1:
        raise BadParam("n must be 1: specd returns one choice per request", "n")
    _refuse_unsupported(body, _UNSUPPORTED_COMMON)
    temperature = _number(body, "temperature")
    if temperature is not None:
        req.sampling.temperature = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        req.sampling.top_p = top_p
    top_k = body.get("top_k")
    if top_k is not None and top_k != -1:  # vLLM: -1 (or 0) turns it off
        req.sampling.top_k = _int(body, "top_k") or 0
    min_p = _number(body, "min_p")
    if min_p is not None:
        req.sampling.min_p = min_p
    seed = _int(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        req.sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        raise BadParam("stop must be a string or a list of strings", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= UINT32_MAX for t in ids):
            raise BadParam("stop_token_ids must be a list of token IDs (integers >= 0)", "stop_token_ids")
        req.stop_token_ids.extend(ids)
    req.ignore_eos = _bool(body, "ignore_eos")
    req.cache_salt = _str(body, "cache_salt") or ""
    _str(body, "user")  # accepted, and only type-checked: a claim, not an identity
    mode = _str(body, "speculation")
    if mode is not None:
        if mode not in _MODES:
            raise BadParam(f"speculation must be one of {', '.join(_MODES)} (got {mode!r})", "speculation")
        req.speculation.mode = _MODES[mode]
    draft_length = _int(body, "draft_length")
    if draft_length is not None:
        req.speculation.draft_length = draft_length
        if mode is None:  # a draft length alone asks for it, as `specd generate --draft-length` does
            req.speculation.mode = common_pb2.SpeculationParams.MODE_FIXED
    pipeline = _str(body, "pipeline")
    if pipeline is not None:
        if pipeline not in _PIPELINES:
            raise BadParam(f"pipeline must be one of {', '.join(_PIPELINES)} (got {pipeline!r})", "pipeline")
        req.speculation.pipeline = _PIPELINES[pipeline]
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise BadParam("stream_options must be an object", "stream_options")
        if not stream:
            raise BadParam("stream_options is only allowed with stream: true", "stream_options")
        include_usage = _bool(options, "include_usage")
    return stream, include_usage


def _max_tokens(body: Mapping[str, Any], names: Sequence[str], default: int) -> int:
    for name in names:
        value = _int(body, name, 1, UINT32_MAX)
        if value is not None:
            return value
    return default


def parse_completion(body: Any, models: Sequence[str]) -> OpenAIRequest:
    """POST /v1/completions. max_tokens defaults to 16, as OpenAI's does."""
    if not isinstance(body, dict):
        raise BadParam("the request body must be a JSON object")
    model = _model(body, models)
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    req = coordinator_pb2.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t <= UINT32_MAX for t in prompt):
            raise BadParam("prompt token IDs must be integers >= 0", "prompt")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadParam("prompt must be one prompt (a string or a list of token IDs); send a batch as requests")
    else:
        raise BadParam("prompt must be a string or a list of token IDs", "prompt")
    req.max_new_tokens = _max_tokens(body, ("max_tokens",), 16)
    stream, include_usage = _common(body, req)
    return OpenAIRequest(
        COMPLETION,
        req,
        model,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
    )


def parse_chat(body: Any, models: Sequence[str]) -> OpenAIRequest:
    """POST /v1/chat/completions. max_completion_tokens (or max_tokens) defaults to the server's default."""
    if not isinstance(body, dict):
        raise BadParam("the request body must be a JSON object")
    model = _model(body, models)
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadParam("response_format is not supported by specd (only {'type': 'text'})", "response_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadParam("messages must be a non-empty list of {role, content} objects", "messages")
    req = coordinator_pb2.GenerateRequest()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadParam(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise BadParam(f"messages[{i}].role {role!r} is not supported; use one of {sorted(_ROLES)}", "messages")
        req.chat.messages.add(role=_ROLES[role], content=_content(m.get("content"), i))
    req.max_new_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), 0)  # 0: the server's
    stream, include_usage = _common(body, req)
    return OpenAIRequest(
        CHAT,
        req,
        model,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadParam(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadParam(f"messages[{i}].content must be a string or a list of text parts", "messages")


# ---- Chunks -> OpenAI objects -------------------------------------------------------------------


def specd_stats(stats: RequestStats) -> dict[str, Any]:
    """Every number of the request, as `specd generate --json` prints them."""
    out = MessageToDict(
        stats_to_proto(stats), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out["seed"] = int(out.get("seed", 0))  # uint64 comes out of protobuf's JSON as a string
    return out


def usage(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's usage, with speculation's numbers: draft tokens offered and accepted.

    completion_tokens_details names them as OpenAI's predicted outputs do (accepted and
    rejected prediction tokens); the flat keys are specd's own."""
    r = stats.rounds
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": r.accepted_tokens,
            "rejected_prediction_tokens": r.draft_tokens - r.accepted_tokens,
        },
        "draft_tokens": r.draft_tokens,
        "accepted_tokens": r.accepted_tokens,
        "acceptance_rate": r.acceptance_rate,
        "acceptance_length": r.acceptance_length,
    }


@dataclass
class Completion:
    """A whole request's output, gathered from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.stats is not None:
            self.stats = chunk.stats


def _head(oa: OpenAIRequest, streaming: bool) -> dict[str, Any]:
    obj = oa.kind if not streaming or oa.kind == COMPLETION else "chat.completion.chunk"
    return {"id": oa.response_id, "object": obj, "created": oa.created, "model": oa.model}


def response(oa: OpenAIRequest, done: Completion) -> dict[str, Any]:
    """The completion (or chat completion) object of a finished request."""
    finish = FINISH_REASONS[done.finish_reason] if done.finish_reason is not None else None
    choice: dict[str, Any] = {"index": 0}
    if oa.kind == COMPLETION:
        choice["text"] = done.text
    else:
        choice["message"] = {"role": "assistant", "content": done.text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    if oa.return_token_ids:
        choice["token_ids"] = done.token_ids
    out = _head(oa, streaming=False)
    out["choices"] = [choice]
    if done.stats is not None:
        out["usage"] = usage(done.stats)
        out["specd"] = specd_stats(done.stats)
    return out


def stream_chunk(oa: OpenAIRequest, chunk: Chunk | None, *, first: bool = False) -> dict[str, Any] | None:
    """One SSE event's object for a chunk (None: nothing to send yet); chunk None with first: the role.

    Chat streams open with the assistant's role, as OpenAI's do. The chunk that ends the
    request has finish_reason and the `specd` stats; usage comes after it (usage_chunk)."""
    out = _head(oa, streaming=True)
    if chunk is None:
        if not first or oa.kind == COMPLETION:
            return None
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    else:
        if not chunk.text and chunk.finish_reason is None and not (oa.return_token_ids and chunk.token_ids):
            return None  # the detokenizer is holding text back (a partial character or stop string)
        finish = FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason is not None else None
        if oa.kind == COMPLETION:
            choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish}
        else:
            delta = {"content": chunk.text} if chunk.text or finish is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if oa.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
        if chunk.stats is not None:
            out["specd"] = specd_stats(chunk.stats)
    out["choices"] = [choice]
    if oa.include_usage:
        out["usage"] = None
    return out


def usage_chunk(oa: OpenAIRequest, stats: RequestStats) -> dict[str, Any]:
    """The last event of a stream with include_usage: no choices, the request's usage."""
    out = _head(oa, streaming=True)
    out["choices"] = []
    out["usage"] = usage(stats)
    return out


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def models_list(names: Sequence[str], *, created: int, max_context: int) -> dict[str, Any]:
    """GET /v1/models: every name the model is served under."""
    return {
        "object": "list",
        "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "specd", "max_model_len": max_context}
            for n in names
        ],
    }
