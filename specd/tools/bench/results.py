"""What one request gave: tokens, per-round sizes and client-side times."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """What one prompt gave in one mode: tokens, per-round sizes and client-side times."""

    prompt_id: str
    token_ids: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one entry per token after the first message
    round_tokens: list[int] = field(default_factory=list)  # tokens committed per round (= per stream message)
    drafted: list[int] | None = None  # draft tokens per round, when known exactly (the HF baseline)
    stats: dict[str, Any] | None = None  # the service's GenerateStats
    error: str | None = None


class Timeline:
    """Arrival times of token groups: TTFT from the first, per-token inter-token latency from the rest.

    A group of n tokens that arrives `gap` after the previous group counts
    n inter-token latencies of gap / n each (spread evenly).
    """

    def __init__(self, result: RequestResult) -> None:
        self.r = result
        self.prev: float | None = None

    def add(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.prev is None:
            self.r.ttft_s = now - self.r.start
        else:
            self.r.itl_s.extend([(now - self.prev) / n] * n)
        self.prev = now
        self.r.round_tokens.append(n)
