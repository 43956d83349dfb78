"""What one request has committed, and when it stops.

Pure bookkeeping, no I/O: the round loop (specd.core.rounds.loop) drives one
`Generation` per request, whatever the transport.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from specd.core.errors import InvalidArgument


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP_TOKEN = "stop_token"  # end-of-sequence or a requested stop token
    STOP_STRING = "stop_string"  # a requested stop string (decided by the caller's stop check)
    CONTEXT_FULL = "context_full"  # the model's context window is full


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
    """The committed tokens of one request."""

    def __init__(self, prompt: Sequence[int], rule: StopRule) -> None:
        rule.validate(len(prompt))
        self.prompt = [int(t) for t in prompt]
        self.rule = rule
        self.generated: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def committed_length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def draft_budget(self, wanted: int, after: int = 0) -> int:
        """Draft tokens worth asking for this round: never past max_new_tokens or the context.

        A round commits accepted + 1 tokens, so K = remaining - 1 can finish the request.
        after: the budget of the round after one that commits this many more tokens.
        """
        remaining = self.rule.max_new_tokens - len(self.generated) - after
        room = self.rule.max_context - self.committed_length - after
        return max(0, min(wanted, remaining - 1, room - 1))

    def commit(self, drafts: Sequence[int], accepted: int, token: int | None) -> list[int]:
        """Apply one verdict; return the tokens committed (cut at a stop token or limit).

        token: the recovered or bonus token; None when the bonus was deferred
        (every draft accepted, the next round's first draft takes its place).
        """
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
