"""The names in specd's traces: service names, span names, attribute names, token kinds.

vLLM's words throughout (drafts, draft tokens, accepted, recovered, bonus);
the GenAI conventions' names (specd.serving.genai) where they name a thing.
docs/observability.md shows where each appears in a trace.
"""

from __future__ import annotations

from specd.serving import genai

# ---- service names (resource service.name) ------------------------------------

SERVICE_COORDINATOR = "specd-coordinator"
SERVICE_DRAFT = "specd-draft"
SERVICE_TARGET = "specd-target"
SERVICE_NAMES = {"coordinator": SERVICE_COORDINATOR, "draft": SERVICE_DRAFT, "target": SERVICE_TARGET}
INSTRUMENTATION_NAME = "specd"

# ---- span names ------------------------------------------------------------------

# The Generate span follows the GenAI conventions: "text_completion MODEL" (genai.span_name).
SPAN_GENERATE = genai.OPERATION  # its name without the model, and its gen_ai.operation.name
SPAN_ROUND = "specd.round"
SPAN_DRAFT_OPEN = "specd.draft.open"
SPAN_DRAFT_PROPOSE = "specd.draft.propose"
SPAN_DRAFT_CLOSE = "specd.draft.close"
SPAN_TARGET_OPEN = "specd.target.open"
SPAN_TARGET_VERIFY = "specd.target.verify"
SPAN_TARGET_CLOSE = "specd.target.close"
# Phase spans, children of a propose / verify span (see specd.core.phases): PREFIX + phase name,
# e.g. specd.target.forward, specd.draft.sampling, specd.target.rollback.
SPAN_DRAFT_PHASE_PREFIX = "specd.draft."
SPAN_TARGET_PHASE_PREFIX = "specd.target."

# ---- attribute names (vLLM's words: drafts, draft tokens, accepted, recovered, bonus) ----

# generic RPC attributes (OpenTelemetry semantic conventions)
ATTR_RPC_SYSTEM = "rpc.system"
ATTR_RPC_SERVICE = "rpc.service"
ATTR_RPC_METHOD = "rpc.method"

ATTR_SESSION_ID = "specd.session_id"  # hashed (hashed_session_id): a span reader cannot name a live session
ATTR_COMMITTED_LENGTH = "specd.committed_length"  # tokens committed before this round / message
ATTR_ERROR_TYPE = "error.type"  # semconv: the exception class that failed the operation
ATTR_CANCELLED = "specd.cancelled"

# Generate span: request settings. Where the GenAI conventions name a setting, that name
# (gen_ai.request.*); specd's own settings keep specd.request.*.
ATTR_GENAI_OPERATION = genai.ATTR_OPERATION
ATTR_MODEL = genai.ATTR_REQUEST_MODEL
ATTR_PROMPT_TOKENS = genai.ATTR_USAGE_INPUT_TOKENS
ATTR_MAX_NEW_TOKENS = genai.ATTR_REQUEST_MAX_TOKENS
ATTR_TEMPERATURE = genai.ATTR_REQUEST_TEMPERATURE
ATTR_TOP_K = genai.ATTR_REQUEST_TOP_K
ATTR_TOP_P = genai.ATTR_REQUEST_TOP_P
ATTR_SEED = genai.ATTR_REQUEST_SEED
ATTR_MIN_P = "specd.request.min_p"
ATTR_SPECULATION = "specd.request.speculation"  # auto | fixed | off
ATTR_REQUEST_DRAFT_LENGTH = "specd.request.draft_length"  # K the request runs with
# How many stop strings; the strings (gen_ai.request.stop_sequences) are never recorded: secrets, user text.
ATTR_STOP_STRINGS = "specd.request.stop_strings"
# Generate span: the response (GenAI) and the final stats (the response's GenerateStats)
ATTR_RESPONSE_ID = genai.ATTR_RESPONSE_ID  # = specd.session_id
ATTR_RESPONSE_MODEL = genai.ATTR_RESPONSE_MODEL
ATTR_FINISH_REASONS = genai.ATTR_RESPONSE_FINISH_REASONS  # ["stop"] or ["length"]
ATTR_COMPLETION_TOKENS = genai.ATTR_USAGE_OUTPUT_TOKENS
ATTR_FINISH_REASON = "specd.finish_reason"  # the exact reason: length, stop_token, stop_string, context_full
ATTR_ROUNDS = "specd.rounds"
ATTR_DRAFTS = "specd.drafts"  # rounds that verified >= 1 draft token
ATTR_DRAFT_TOKENS = "specd.draft_tokens"
ATTR_ACCEPTED_TOKENS = "specd.accepted_tokens"
ATTR_ACCEPTANCE_LENGTH = "specd.acceptance_length"  # 1 + accepted / drafts
ATTR_ACCEPTANCE_RATE = "specd.acceptance_rate"  # accepted / draft tokens
ATTR_TARGET_ONLY_ROUNDS = "specd.target_only_rounds"
ATTR_PIPELINE_HITS = "specd.pipeline_hits"  # rounds whose drafts were made during the previous verify
ATTR_TTFT_MS = "specd.time_to_first_token_ms"
ATTR_TOKENS_PER_S = "specd.tokens_per_s"
ATTR_DRAFT_MS = "specd.draft_ms"  # draft model compute (reported by the draft)
ATTR_VERIFY_MS = "specd.verify_ms"  # target model compute (reported by the target)
ATTR_OVERHEAD_MS = "specd.overhead_ms"  # wall time minus both: network, queues, coordinator

# Round span
ATTR_ROUND_INDEX = "specd.round.index"  # 0-based within the request
ATTR_ROUND_DRAFT_LENGTH = "specd.round.draft_length"  # K asked of the draft (0: target-only round)
ATTR_ROUND_DRAFT_TOKENS = "specd.round.draft_tokens"  # draft tokens verified
ATTR_ROUND_ACCEPTED = "specd.round.accepted"  # draft tokens accepted
ATTR_ROUND_TOKEN_KIND = "specd.round.token_kind"  # the extra token: "recovered", "bonus" or "deferred"
ATTR_ROUND_TOKENS = "specd.round.tokens"  # tokens committed (accepted + 1, cut at a stop)
ATTR_ROUND_TARGET_ONLY = "specd.round.target_only"  # wanted draft tokens, got none (draft down or failing)
ATTR_ROUND_PIPELINE_HIT = "specd.round.pipeline_hit"  # the round's draft came from pipelining
ATTR_ROUND_TARGET_ONLY_REASON = "specd.round.target_only_reason"  # why no draft tokens were verified ("" if some were)
ATTR_ROUND_PIPELINE_OUTCOME = "specd.round.pipeline_outcome"  # the hit's outcome "accepted:kind" ("" if no hit)
ATTR_ROUND_PIPELINE = "specd.round.pipeline"  # the pipeline strategy the round ran (auto: chosen per round)
ATTR_ROUND_PIPELINE_LAUNCHED = "specd.round.pipeline_launched"  # pre-drafts launched for the next round
ATTR_ROUND_STAGED = "specd.round.staged"  # the target verified the round's pre-draft itself (staged: no round trip)
ATTR_ROUND_DRAFT_MS = "specd.round.draft_ms"
ATTR_ROUND_VERIFY_MS = "specd.round.verify_ms"
ATTR_ROUND_OVERHEAD_MS = "specd.round.overhead_ms"
ATTR_ROUND_WALL_MS = "specd.round.wall_ms"
ATTR_TARGET_REPLICA = "specd.target.replica"  # the target replica (address) holding the session
ATTR_DRAFT_REPLICA = "specd.draft.replica"  # the draft replica holding the session (absent: none yet)

# Draft and target spans
ATTR_NUM_TOKENS = "specd.draft.num_tokens"  # K asked (propose)
ATTR_COMPUTE_MS = "specd.compute_ms"  # model time of this message
ATTR_ACCEPTED = "specd.accepted"  # target verify: draft tokens accepted
ATTR_TOKEN_KIND = "specd.token_kind"  # target verify: "recovered" or "bonus"
ATTR_SESSION_ERROR = "specd.session_error"  # in-band error code sent back to the coordinator
ATTR_BATCH_SIZE = "specd.batch_size"  # sessions that shared this step's forward pass
ATTR_PHASE_MS = "specd.phase_ms"  # phase span: time spent in the phase (a draft's K steps summed)

TOKEN_KIND_BONUS = "bonus"
TOKEN_KIND_RECOVERED = "recovered"
TOKEN_KIND_DEFERRED = "deferred"  # post-verify pipelining: all accepted, the bonus left to the next round
