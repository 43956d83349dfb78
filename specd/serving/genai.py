"""OpenTelemetry GenAI semantic conventions as specd applies them: names, values, buckets.

One place for the words generic GenAI tooling reads (span name, `gen_ai.*`
attributes, the `gen_ai.server.*` metrics), so the span (specd.serving.tracing)
and the metrics (specd.serving.metrics) say the same thing.

- Operation: a Generate call continues a prompt (text or token IDs), so it is
  the well-known `text_completion`; the provider is `specd` (a custom value).
- Span name: `{gen_ai.operation.name} {gen_ai.request.model}`, e.g.
  `text_completion SmolLM2-135M-Instruct`; just the operation when the model is unknown.
- Metrics keep the OTel names with the OTel -> Prometheus rules applied (dots
  become underscores, the unit `s` becomes `_seconds`):
  gen_ai.server.request.duration -> gen_ai_server_request_duration_seconds,
  gen_ai.server.time_to_first_token -> gen_ai_server_time_to_first_token_seconds,
  gen_ai.server.time_per_output_token -> gen_ai_server_time_per_output_token_seconds;
  attribute keys become labels the same way (gen_ai.request.model -> gen_ai_request_model).
"""

from __future__ import annotations

OPERATION = "text_completion"  # gen_ai.operation.name
PROVIDER = "specd"  # gen_ai.provider.name (custom value: the server is its own provider)

# ---- span attributes ------------------------------------------------------------

ATTR_OPERATION = "gen_ai.operation.name"
ATTR_PROVIDER = "gen_ai.provider.name"
ATTR_REQUEST_MODEL = "gen_ai.request.model"
ATTR_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
ATTR_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
ATTR_REQUEST_TOP_P = "gen_ai.request.top_p"
ATTR_REQUEST_TOP_K = "gen_ai.request.top_k"
ATTR_REQUEST_SEED = "gen_ai.request.seed"
ATTR_RESPONSE_ID = "gen_ai.response.id"  # specd: the request's session ID (specd.session_id)
ATTR_RESPONSE_MODEL = "gen_ai.response.model"
ATTR_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
ATTR_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

# specd's finish reasons (specd.core.rounds.generation.FinishReason values) in the words GenAI tooling
# knows (OpenAI's): a natural or requested stop is "stop", running out of room is "length".
# The exact reason stays on the span as specd.finish_reason.
_FINISH_REASONS = {
    "length": "length",
    "context_full": "length",
    "stop_token": "stop",
    "stop_string": "stop",
}


def span_name(model: str) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, or the operation alone without a model."""
    return f"{OPERATION} {model}" if model else OPERATION


def finish_reasons(reason: str) -> list[str]:
    """gen_ai.response.finish_reasons of one generation (specd returns one per request)."""
    return [_FINISH_REASONS.get(reason, reason)]


# ---- metrics (Prometheus names and labels) ------------------------------------------

METRIC_REQUEST_DURATION = "gen_ai_server_request_duration_seconds"
METRIC_TIME_TO_FIRST_TOKEN = "gen_ai_server_time_to_first_token_seconds"
METRIC_TIME_PER_OUTPUT_TOKEN = "gen_ai_server_time_per_output_token_seconds"

LABEL_OPERATION = "gen_ai_operation_name"
LABEL_PROVIDER = "gen_ai_provider_name"
LABEL_REQUEST_MODEL = "gen_ai_request_model"
LABEL_ERROR_TYPE = "error_type"  # request duration only; "" (no label in Prometheus) on success
LABELS = (LABEL_OPERATION, LABEL_PROVIDER, LABEL_REQUEST_MODEL)

# The explicit bucket boundaries the conventions give for each server metric (seconds).
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
