"""Filling specd's spans: errors, and the attribute sets of requests, rounds and draft/target messages.

Each function takes a span that may be a no-op (INVALID_SPAN, or not
sampled) and does nothing then.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from specd.core.rounds.record import RoundRecord
from specd.serving import genai, trace_names


def hashed_session_id(session_id: str) -> str:
    """What spans record for a session: 32 hex digits of its SHA-256 (shaped like the ID). The same on every
    service, so the coordinator's and the peers' spans of one session still match."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:32]


def error_name(exc: BaseException) -> str:
    """A short, bounded name for what ended an operation ("cancelled" for a cancellation)."""
    return "cancelled" if isinstance(exc, (asyncio.CancelledError, GeneratorExit)) else type(exc).__name__


def record_error(span: Span, exc: BaseException) -> None:
    """Mark `span` failed by `exc` (a cancellation is marked as such, without a stack)."""
    if not span.is_recording():
        return
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.set_attribute(trace_names.ATTR_CANCELLED, True)
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    span.set_attribute(trace_names.ATTR_ERROR_TYPE, type(exc).__name__)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def end_message_span(
    span: Span | None,
    attributes: Mapping[str, Any] | None,
    error: tuple[str, str] | None,
    end_time: int | None = None,
) -> None:
    """End a draft/target message span: its result attributes, or the in-band error (code, message);
    end_time: when (ns since the epoch) the message was answered, if that was before now."""
    if span is None:
        return
    if span.is_recording():
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_attribute(trace_names.ATTR_SESSION_ERROR, error[0])
            span.set_status(Status(StatusCode.ERROR, f"{error[0]}: {error[1]}"))
    span.end(end_time=end_time)


def token_kind(is_bonus: bool, deferred: bool = False) -> str:
    if deferred:
        return trace_names.TOKEN_KIND_DEFERRED
    return trace_names.TOKEN_KIND_BONUS if is_bonus else trace_names.TOKEN_KIND_RECOVERED


def request_attributes(spec: Any) -> dict[str, Any]:
    """Generate-span attributes of a validated request (specd.core.rounds.loop.GenerateSpec)."""
    p = spec.params
    attributes: dict[str, Any] = {
        trace_names.ATTR_PROMPT_TOKENS: len(spec.prompt_ids),
        trace_names.ATTR_MAX_NEW_TOKENS: spec.max_new_tokens,
        trace_names.ATTR_TEMPERATURE: float(p.temperature),
        trace_names.ATTR_TOP_K: float(p.top_k),  # a double in the conventions; 0 = off
        trace_names.ATTR_TOP_P: float(p.top_p),
        trace_names.ATTR_MIN_P: float(p.min_p),
        trace_names.ATTR_SEED: int(p.seed),
        trace_names.ATTR_SPECULATION: spec.speculation,
        trace_names.ATTR_REQUEST_DRAFT_LENGTH: 0 if spec.speculation == "off" else int(spec.draft_length),
        # How many stop strings, never the strings: they may be secrets or the user's text.
        trace_names.ATTR_STOP_STRINGS: len(spec.stop_strings),
    }
    return attributes


def stats_attributes(stats: Any, finish_reason: str) -> dict[str, Any]:
    """Generate-span attributes of a finished request (specd.core.rounds.record.RequestStats)."""
    r = stats.rounds
    return {
        trace_names.ATTR_FINISH_REASON: finish_reason,
        trace_names.ATTR_FINISH_REASONS: genai.finish_reasons(finish_reason),
        trace_names.ATTR_ROUNDS: r.rounds,
        trace_names.ATTR_DRAFTS: r.drafts,
        trace_names.ATTR_DRAFT_TOKENS: r.draft_tokens,
        trace_names.ATTR_ACCEPTED_TOKENS: r.accepted_tokens,
        trace_names.ATTR_ACCEPTANCE_LENGTH: float(r.acceptance_length),
        trace_names.ATTR_ACCEPTANCE_RATE: float(r.acceptance_rate),
        trace_names.ATTR_TARGET_ONLY_ROUNDS: r.target_only_rounds,
        trace_names.ATTR_PIPELINE_HITS: r.pipeline_hits,
        trace_names.ATTR_COMPLETION_TOKENS: stats.completion_tokens,
        trace_names.ATTR_TTFT_MS: float(stats.time_to_first_token_ms),
        trace_names.ATTR_TOKENS_PER_S: float(stats.tokens_per_s),
        trace_names.ATTR_DRAFT_MS: float(stats.draft_ms),
        trace_names.ATTR_VERIFY_MS: float(stats.verify_ms),
        trace_names.ATTR_OVERHEAD_MS: float(stats.overhead_ms),
    }


def finish_generate(span: Span, stats: Any, finish_reason: str) -> None:
    """Set a finished request's attributes on its Generate span.

    gen_ai.response.id is the request's session ID, which the engine set on
    the span as specd.session_id when the request started.
    """
    if not span.is_recording():
        return
    attributes = stats_attributes(stats, finish_reason)
    session_id = (getattr(span, "attributes", None) or {}).get(trace_names.ATTR_SESSION_ID)  # an SDK span's attributes
    if session_id:
        attributes[trace_names.ATTR_RESPONSE_ID] = session_id
    span.set_attributes(attributes)


def round_attributes(record: RoundRecord) -> dict[str, Any]:
    """Round-span attributes, set once when the round has committed (all from its record)."""
    hit = record.pipeline_hit
    return {
        trace_names.ATTR_ROUND_DRAFT_LENGTH: record.draft_length,
        trace_names.ATTR_ROUND_DRAFT_TOKENS: record.draft_tokens,
        trace_names.ATTR_ROUND_ACCEPTED: record.accepted,
        trace_names.ATTR_ROUND_TOKEN_KIND: record.token_kind.value,
        trace_names.ATTR_ROUND_TOKENS: record.tokens,
        trace_names.ATTR_ROUND_TARGET_ONLY: record.fallback,
        trace_names.ATTR_ROUND_TARGET_ONLY_REASON: record.target_only.value if record.target_only is not None else "",
        trace_names.ATTR_ROUND_PIPELINE_HIT: hit is not None,
        trace_names.ATTR_ROUND_PIPELINE_OUTCOME: hit.outcome if hit is not None else "",
        trace_names.ATTR_ROUND_PIPELINE_LAUNCHED: record.pipeline_launched,
        trace_names.ATTR_ROUND_PIPELINE: record.pipeline,
        trace_names.ATTR_ROUND_STAGED: record.staged,
        trace_names.ATTR_ROUND_DRAFT_MS: float(record.draft_ms),
        trace_names.ATTR_ROUND_VERIFY_MS: float(record.verify_ms),
        trace_names.ATTR_ROUND_OVERHEAD_MS: float(record.overhead_ms),
        trace_names.ATTR_ROUND_WALL_MS: float(record.wall_ms),
    }
