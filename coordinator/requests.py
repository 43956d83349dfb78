"""GenerateRequest -> GenerateSpec: the public edge's validation and translation.

Every rejection is an InvalidArgument whose message says what to fix. Order
matters for a public port: first the sizes, from lengths alone (`check_sizes`:
no per-item work on a field before its count is known to be within its cap),
then admission (the caller's `admit`, so that an overloaded coordinator refuses
before it tokenizes), then the per-item checks and tokenization.
"""

from __future__ import annotations

import math
import secrets

from transformers import PreTrainedTokenizerBase

from specd.core.errors import InvalidArgument
from specd.core.rounds.auto import PIPELINE_AUTO
from specd.core.rounds.loop import GenerateSpec
from specd.core.rounds.tree_rounds import TREE_PIPELINES
from specd.core.sampling.sampler import SamplingParams
from specd.serving.config import CoordinatorConfig
from specd.serving.tenancy import tenant_key
from specd.serving.wire import params_from_proto
from specd.v1 import common_pb2, coordinator_pb2

CHAT_ROLES = frozenset({"system", "user", "assistant"})
_MODES = {
    common_pb2.SpeculationParams.MODE_UNSPECIFIED: None,
    common_pb2.SpeculationParams.MODE_AUTO: "auto",
    common_pb2.SpeculationParams.MODE_FIXED: "fixed",
    common_pb2.SpeculationParams.MODE_OFF: "off",
}
_PIPELINES = {
    common_pb2.SpeculationParams.PIPELINE_UNSPECIFIED: None,
    common_pb2.SpeculationParams.PIPELINE_OFF: "off",
    common_pb2.SpeculationParams.PIPELINE_BONUS_MATCH: "bonus-match",
    common_pb2.SpeculationParams.PIPELINE_POST_VERIFY: "post-verify",
    common_pb2.SpeculationParams.PIPELINE_SPEC_CACHE: "spec-cache",
    common_pb2.SpeculationParams.PIPELINE_AUTO: PIPELINE_AUTO,
}


# Characters per token of context that a prompt may have when --max-prompt-chars is 0 (auto).
CHARS_PER_TOKEN = 32


def prompt_chars_limit(config: CoordinatorConfig, max_context: int) -> int:
    """The longest prompt text (or chat content) accepted: --max-prompt-chars, or 32 x the context."""
    return config.max_prompt_chars or CHARS_PER_TOKEN * max_context


def public_message_limit(config: CoordinatorConfig, max_context: int) -> int:
    """The public port's receive limit: the largest prompt the model can take (4 UTF-8 bytes per
    character, 5 bytes per token ID), plus 1 MiB for everything else. A larger message is refused
    by gRPC before it is read (RESOURCE_EXHAUSTED)."""
    return (1 << 20) + 4 * prompt_chars_limit(config, max_context) + 8 * max_context


def public_body_limit(config: CoordinatorConfig, max_context: int) -> int:
    """The HTTP API's request body limit: public_message_limit's, with 6 bytes per prompt character
    instead of 4 (JSON may escape every character as \\uXXXX) and 8 per token ID (digits and a
    comma). A larger body is refused with 413 before it is read."""
    return (1 << 20) + 6 * prompt_chars_limit(config, max_context) + 8 * max_context


def check_sizes(req: coordinator_pb2.GenerateRequest, config: CoordinatorConfig, max_context: int) -> None:
    """Every size cap of a request, from lengths alone: cheap enough to run before admission."""
    chars = prompt_chars_limit(config, max_context)
    kind = req.WhichOneof("prompt")
    if kind == "text" and len(req.text) > chars:
        raise InvalidArgument(f"the prompt has {len(req.text)} characters; the limit is {chars}")
    if kind == "token_ids" and len(req.token_ids.ids) >= max_context:
        raise InvalidArgument(
            f"the prompt has {len(req.token_ids.ids)} tokens; the model's context is {max_context}, so shorten the prompt"
        )
    if kind == "chat":
        if len(req.chat.messages) > config.max_chat_messages:
            raise InvalidArgument(
                f"chat has {len(req.chat.messages)} messages; the limit is {config.max_chat_messages}"
            )
        if sum(len(m.content) + len(m.role) for m in req.chat.messages) > chars:
            raise InvalidArgument(f"the chat messages exceed {chars} characters")
    if len(req.stop) > config.max_stop_strings:
        raise InvalidArgument(f"{len(req.stop)} stop strings given; the limit is {config.max_stop_strings}")
    if len(req.stop_token_ids) > config.max_stop_token_ids:
        raise InvalidArgument(
            f"{len(req.stop_token_ids)} stop token ids given; the limit is {config.max_stop_token_ids}"
        )


def prompt_ids(
    req: coordinator_pb2.GenerateRequest, tokenizer: PreTrainedTokenizerBase, config: CoordinatorConfig, vocab_size: int
) -> list[int]:
    """The prompt as token IDs (after check_sizes)."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("the request has no prompt; set one of text, token_ids or chat")
    if kind == "text":
        if not req.text:
            raise InvalidArgument("the prompt text is empty; send some text")
        ids = list(tokenizer(req.text, add_special_tokens=False).input_ids)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidArgument(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); send IDs from the model's tokenizer"
            )
    else:
        messages = []
        for i, m in enumerate(req.chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"chat message {i} has role {m.role!r}; use one of {sorted(CHAT_ROLES)}")
            messages.append({"role": m.role, "content": m.content})
        if not messages:
            raise InvalidArgument("chat has no messages; send at least one")
        if not tokenizer.chat_template:
            raise InvalidArgument("the model has no chat template; send text or token_ids instead")
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if not ids:
        raise InvalidArgument("the prompt is empty after tokenization; send some text or token IDs")
    return ids


def sampling_params(req: coordinator_pb2.GenerateRequest) -> SamplingParams:
    s = req.sampling
    for name in ("temperature", "top_p"):
        if s.HasField(name) and not math.isfinite(getattr(s, name)):
            raise InvalidArgument(f"sampling.{name} must be a finite number")
    seed = s.seed if s.HasField("seed") else secrets.randbits(63)
    if seed >= 2**63:
        raise InvalidArgument("sampling.seed must be < 2**63")
    return params_from_proto(s, seed=seed).validate()


def spec_from_prompt(
    req: coordinator_pb2.GenerateRequest,
    ids: list[int],
    config: CoordinatorConfig,
    *,
    vocab_size: int,
    max_context: int,
    eos_token_ids: frozenset[int],
    identity: str = "",
) -> GenerateSpec:
    """The validated request, its prompt already tokenized (prompt_ids, after check_sizes)."""
    tenant = tenant_key(identity, req.cache_salt)
    if len(ids) >= max_context:
        raise InvalidArgument(
            f"the prompt has {len(ids)} tokens; the model's context is {max_context}, so shorten the prompt"
        )
    if req.max_new_tokens > config.max_new_tokens_limit:
        raise InvalidArgument(f"max_new_tokens is {req.max_new_tokens}; the limit is {config.max_new_tokens_limit}")
    room = max_context - len(ids)
    if req.max_new_tokens == 0:
        max_new = min(config.default_max_new_tokens, room)
    elif req.max_new_tokens > room:
        raise InvalidArgument(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the context of "
            f"{max_context}; ask for at most {room} new tokens"
        )
    else:
        max_new = req.max_new_tokens
    if any(not s for s in req.stop):
        raise InvalidArgument("stop strings must not be empty")
    if any(len(s) > 256 for s in req.stop):
        raise InvalidArgument("stop strings must be at most 256 characters")
    bad_stop = [t for t in req.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidArgument(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
    if req.speculation.mode not in _MODES:
        raise InvalidArgument(f"unknown speculation mode {req.speculation.mode}")
    mode = _MODES[req.speculation.mode] or config.speculation
    if req.speculation.pipeline not in _PIPELINES:
        raise InvalidArgument(f"unknown speculation pipeline {req.speculation.pipeline}")
    pipeline = _PIPELINES[req.speculation.pipeline] or config.pipeline
    if pipeline == PIPELINE_AUTO and mode == "fixed" and not _PIPELINES[req.speculation.pipeline]:
        pipeline = "off"  # the default's auto is auto speculation's; a fixed K asks for it by name
    draft_length = config.draft_length
    if mode in ("fixed", "auto") and req.speculation.draft_length:  # auto: the largest K it may pick
        draft_length = req.speculation.draft_length
        if not 1 <= draft_length <= config.max_draft_length:
            raise InvalidArgument(
                f"speculation.draft_length must be in 1..{config.max_draft_length} (got {draft_length})"
            )
    tree_budget = _tree_budget(req.speculation, mode, pipeline, config) if mode != "off" else 0
    return GenerateSpec(
        prompt_ids=ids,
        params=sampling_params(req),
        max_new_tokens=max_new,
        stop_strings=tuple(req.stop),
        stop_token_ids=frozenset(stop_ids),
        speculation=mode,
        draft_length=draft_length,
        tenant=tenant,
        pipeline=pipeline,
        seeded=req.sampling.HasField("seed"),
        tree_budget=tree_budget,
    )


def _tree_budget(s: common_pb2.SpeculationParams, mode: str, pipeline: str, config: CoordinatorConfig) -> int:
    """speculation.tree_budget, checked: within --max-tree-budget, with fixed speculation, pipeline off or
    bonus-match (docs/trees.md)."""
    if not s.tree_budget:
        return 0
    if s.tree_budget > config.max_tree_budget:
        raise InvalidArgument(
            f"speculation.tree_budget must be in 0..{config.max_tree_budget} nodes (got {s.tree_budget})"
        )
    if mode != "fixed":
        raise InvalidArgument(
            "speculation.tree_budget needs speculation mode MODE_FIXED (its draft_length is the depth)"
        )
    if pipeline not in TREE_PIPELINES:
        raise InvalidArgument(
            "speculation.tree_budget needs pipeline PIPELINE_OFF (or unset) or PIPELINE_BONUS_MATCH: "
            "trees are pipelined by bonus-match only"
        )
    return s.tree_budget
