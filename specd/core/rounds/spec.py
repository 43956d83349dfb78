"""What a request asks of the round loop, and the loop's own settings."""

from __future__ import annotations

from dataclasses import dataclass

from specd.core.errors import InvalidArgument
from specd.core.rounds.steps import DEFAULT_BRANCH_BUDGET
from specd.core.sampling.sampler import SamplingParams

SPECULATION_MODES = ("auto", "fixed", "off")
# How a speculating request's first round runs: the draft's call first, then the target's verify of
# the prompt and its drafts ("draft-first"), or the target's prefill alone with the draft's call beside
# it ("beside": specd.core.rounds.request_run.RequestRun._opens_beside)
OPENINGS = ("draft-first", "beside")
OPENING_AUTO = "auto"  # a setting that asks for opening_for(the draft's kinds)


def opening_for(draft_kinds: set[str]) -> str:
    """The opening "auto" stands for, given the drafts' kinds (Drafter.kind, the draft's ModelInfo.kind).

    "beside" for model drafts (and hybrid ones, whose first call has no suffix match to
    go on): their prefill and K passes are worth hiding behind the target's prefill.
    "draft-first" for n-gram and suffix drafts, which cost next to nothing and whose
    opening verify checks K tokens in the prefill's pass; and with no draft known."""
    return "beside" if draft_kinds and draft_kinds <= {"model", "hybrid"} else "draft-first"


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request in core terms."""

    prompt_ids: list[int]
    params: SamplingParams  # seed always set
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()  # applied by the caller's StopCheck (the coordinator's detokenizer)
    stop_token_ids: frozenset[int] = frozenset()
    speculation: str = "auto"  # one of SPECULATION_MODES
    draft_length: int = 4  # fixed K, or the largest K automatic mode may pick
    pipeline: str = "off"  # a name in specd.core.rounds.pipeline.PIPELINES, or "auto": chosen per round
    tenant: str = ""  # the caller's tenant key: the draft's learned state it may use ("": none)
    # The caller chose the seed: the output must reproduce, and which positions are drafted depends on
    # K, so auto keeps K at draft_length and never cuts (its pipeline choice changes no token).
    seeded: bool = False
    tree_budget: int = 0  # > 0: tree rounds, trees of at most this many nodes, draft_length deep (docs/trees.md)


@dataclass(frozen=True)
class LoopSettings:
    draft_timeout_s: float = 5.0  # a draft answer later than this: target-only round
    target_timeout_s: float = 30.0  # per target call, and the retry budget after a first failure
    draft_retry_s: float = 2.0  # after a draft failure, rounds are target-only this long
    close_timeout_s: float = 2.0
    branch_budget: int = DEFAULT_BRANCH_BUDGET  # spec-cache pipelining: the most verdicts pre-drafted per round
    # Fewer when more would not pay (specd.core.rounds.branch_budget); False: always branch_budget.
    adapt_branch_budget: bool = True
    opening: str = "draft-first"  # one of OPENINGS

    def __post_init__(self) -> None:
        if self.opening not in OPENINGS:
            raise InvalidArgument(f"opening must be one of {', '.join(OPENINGS)} (got {self.opening!r})")
