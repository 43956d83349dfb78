"""The round logic: what one request commits per round, when it stops, its stats.

Transport-neutral and synchronous: the coordinator drives the same
`Generation` over gRPC; `speculative_generate` drives it in-process and is the
oracle the service tests compare against.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specd.core.drafting import Drafter
from specd.core.errors import InvalidArgument
from specd.core.proposal import Proposal
from specd.core.sampling import SamplingParams
from specd.core.suffix import LearningDrafter
from specd.core.verification import Verifier, VerifyOutcome


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP_TOKEN = "stop_token"  # end-of-sequence or a requested stop token
    STOP_STRING = "stop_string"  # a requested stop string (decided by the detokenizer)
    CONTEXT_FULL = "context_full"  # the model's context window is full


@dataclass
class RoundStats:
    rounds: int = 0  # rounds run (each commits >= 1 token)
    drafts: int = 0  # rounds that verified >= 1 draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # draft tokens accepted
    target_only_rounds: int = 0  # rounds that wanted draft tokens but got none (draft down, failing, empty)
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = rounds whose draft i was accepted
    pipeline_hits: int = 0  # rounds whose drafts were made while the previous round was verified

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens committed per speculative round."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def record(self, num_draft: int, accepted: int, *, fallback: bool = False) -> None:
        self.rounds += 1
        if num_draft == 0:
            self.target_only_rounds += int(fallback)
            return
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class StopRule:
    max_new_tokens: int
    max_context: int
    stop_token_ids: frozenset[int] = frozenset()

    def validate(self, prompt_length: int) -> None:
        if prompt_length < 1:
            raise InvalidArgument("the prompt is empty; send at least one token")
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if prompt_length >= self.max_context:
            raise InvalidArgument(
                f"the prompt has {prompt_length} tokens but the model's context is {self.max_context}; "
                "shorten the prompt"
            )


class Generation:
    """The committed tokens of one request and the bookkeeping of its rounds."""

    def __init__(self, prompt: Sequence[int], rule: StopRule) -> None:
        rule.validate(len(prompt))
        self.prompt = [int(t) for t in prompt]
        self.rule = rule
        self.generated: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stats = RoundStats()

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def committed_length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def draft_budget(self, wanted: int) -> int:
        """Draft tokens worth asking for this round: never past max_new_tokens or the context.

        A round commits accepted + 1 tokens, so K = remaining - 1 can finish the request.
        """
        remaining = self.rule.max_new_tokens - len(self.generated)
        room = self.rule.max_context - self.committed_length
        return max(0, min(wanted, remaining - 1, room - 1))

    def commit(self, drafts: Sequence[int], accepted: int, token: int | None, *, fallback: bool = False) -> list[int]:
        """Apply one verdict; return the tokens committed (cut at a stop token or limit).

        token: the recovered or bonus token; None when the bonus was deferred
        (every draft accepted, the next round's first draft takes its place).
        fallback: the round wanted draft tokens but had none (counted in stats).
        """
        self.stats.record(len(drafts), accepted, fallback=fallback)
        new = [int(t) for t in drafts[:accepted]] + ([] if token is None else [int(token)])
        out: list[int] = []
        for t in new:
            out.append(t)
            self.generated.append(t)
            if t in self.rule.stop_token_ids:
                self.finish_reason = FinishReason.STOP_TOKEN
            elif len(self.generated) >= self.rule.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
            elif self.committed_length >= self.rule.max_context:
                self.finish_reason = FinishReason.CONTEXT_FULL
            if self.finish_reason is not None:
                break
        return out

    def finish(self, reason: FinishReason, keep: int | None = None) -> None:
        """End early (stop string): keep the first `keep` generated tokens."""
        if keep is not None:
            del self.generated[keep:]
        self.finish_reason = reason


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RoundStats
    seconds: float


def speculative_generate(
    prompt: Sequence[int],
    verifier: Verifier,
    drafter: Drafter | None,
    params: SamplingParams,
    *,
    draft_length: int,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    session_id: str = "local",
) -> GenerationResult:
    """Run rounds in-process until the request stops; drafter None or draft_length 0 = target-only."""
    params.validate()
    if drafter is not None and draft_length < 1:
        raise InvalidArgument(f"draft length K must be >= 1 when speculating (got {draft_length})")
    t0 = time.perf_counter()
    rule = StopRule(max_new_tokens, verifier.runner.max_context, frozenset(int(t) for t in stop_token_ids))
    gen = Generation(prompt, rule)
    verifier.open(session_id, gen.prompt, params)
    draft_known = len(gen.prompt)  # leading committed tokens the drafter's sequence agrees with
    try:
        if drafter is not None:
            drafter.open(session_id, gen.prompt, params)
        while not gen.done:
            k = gen.draft_budget(draft_length) if drafter is not None else 0
            proposal = Proposal([])
            if k > 0:
                assert drafter is not None
                committed = gen.committed
                proposal = drafter.propose(session_id, len(committed), draft_known, committed[draft_known:], k)
            outcome: VerifyOutcome = verifier.verify(session_id, gen.committed_length, proposal)
            draft_known = gen.committed_length + outcome.accepted if k > 0 else draft_known
            gen.commit(proposal.token_ids, outcome.accepted, outcome.token_id)
    finally:
        verifier.close(session_id)
        if drafter is not None:
            if isinstance(drafter, LearningDrafter):  # as the coordinator's close: the whole answer
                committed = gen.committed
                drafter.finish(session_id, len(committed), draft_known, committed[draft_known:])
            drafter.close(session_id)
    assert gen.finish_reason is not None
    return GenerationResult(gen.generated, gen.finish_reason, gen.stats, time.perf_counter() - t0)


def speculative_generate_batch(
    prompts: Sequence[Sequence[int]],
    verifier: Verifier,
    drafter: Drafter | None,
    params: Sequence[SamplingParams],
    *,
    draft_lengths: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
) -> list[GenerationResult]:
    """Many requests in lock-step, one propose_batch and one verify_batch per round.

    What the batched services do, in-process: each result equals
    `speculative_generate` of the same request alone (same tokens greedy and
    seeded). draft_lengths: K per request (0 = target-only for that request).
    """
    if not len(prompts) == len(params) == len(draft_lengths):
        raise InvalidArgument("prompts, params and draft_lengths need one entry per request")
    from specd.core.drafting import ProposeRequest
    from specd.core.verification import VerifyRequest

    t0 = time.perf_counter()
    stops = frozenset(int(t) for t in stop_token_ids)
    gens = [Generation(p, StopRule(max_new_tokens, verifier.runner.max_context, stops)) for p in prompts]
    known = [len(g.prompt) for g in gens]  # leading committed tokens each drafter sequence agrees with
    ids = [f"batch-{i}" for i in range(len(gens))]
    opened: list[str] = []
    try:
        for sid, g, p in zip(ids, gens, params):
            p.validate()
            verifier.open(sid, g.prompt, p)
            opened.append(sid)
            if drafter is not None:
                drafter.open(sid, g.prompt, p)
        while live := [i for i, g in enumerate(gens) if not g.done]:
            want = {i: gens[i].draft_budget(draft_lengths[i]) if drafter is not None else 0 for i in live}
            proposals = {i: Proposal([]) for i in live}
            asks = [i for i in live if want[i] > 0]
            if asks:
                assert drafter is not None
                got = drafter.propose_batch(
                    [
                        ProposeRequest(
                            ids[i], gens[i].committed_length, known[i], gens[i].committed[known[i] :], want[i]
                        )
                        for i in asks
                    ]
                )
                for i, proposal in zip(asks, got):
                    if isinstance(proposal, BaseException):
                        raise proposal
                    proposals[i] = proposal
            outcomes = verifier.verify_batch(
                [VerifyRequest(ids[i], gens[i].committed_length, proposals[i]) for i in live]
            )
            for i, outcome in zip(live, outcomes):
                if isinstance(outcome, BaseException):
                    raise outcome
                if want[i] > 0:
                    known[i] = gens[i].committed_length + outcome.accepted
                gens[i].commit(proposals[i].token_ids, outcome.accepted, outcome.token_id)
    finally:
        for i, sid in enumerate(opened):
            verifier.close(sid)
            if drafter is not None:
                if isinstance(drafter, LearningDrafter):
                    drafter.finish(sid, gens[i].committed_length, known[i], gens[i].committed[known[i] :])
                drafter.close(sid)
    seconds = time.perf_counter() - t0
    out = []
    for g in gens:
        assert g.finish_reason is not None
        out.append(GenerationResult(g.generated, g.finish_reason, g.stats, seconds))
    return out
