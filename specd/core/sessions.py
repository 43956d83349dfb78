"""A bounded table of per-session state, shared by the draft and target engines."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specd.core.errors import ResourceExhausted, SessionNotFound

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    value: T
    last_used: float = field(default_factory=time.monotonic)


class KVBudget:
    """Admission by KV-cache memory: a session is admitted if all held tokens plus its own fit.

    Sessions grow as they generate, so the budget bounds what is admitted, and
    idle expiry and closes give memory back; size it with headroom.
    """

    def __init__(self, max_bytes: int, bytes_per_token: Callable[[], int]) -> None:
        self.max_bytes = max_bytes
        self._bytes_per_token = bytes_per_token

    def admit(self, held_tokens: int, new_tokens: int) -> None:
        if not self.max_bytes:
            return
        per_token = self._bytes_per_token()
        needed = (held_tokens + new_tokens) * per_token
        if needed > self.max_bytes:
            raise ResourceExhausted(
                f"KV-cache budget reached: {held_tokens} tokens held + {new_tokens} new need {needed} bytes, "
                f"the budget is {self.max_bytes} (--max-kv-bytes); retry later"
            )

    def forward_groups(
        self, lengths: Sequence[int], max_batch: int, new_tokens: Sequence[int] | None = None
    ) -> list[list[int]]:
        """Split a batch (indices into `lengths`, session lengths) into forward passes.

        A batched forward pads every session to the longest cache and to the
        most new tokens. Two rules keep that cheap:
        - new tokens: a session whose step runs many more positions than the
          others (a prompt's prefill next to K+1-token verifies) gets its own
          pass: a group's most new tokens stay within 2 x its fewest + 16;
        - memory: the padded copy holds n x L positions for n sessions of at
          most L tokens; with a budget each group's copy stays within
          max_bytes, so a step never needs more than twice the budget (the
          admitted sessions plus one pass's copy).
        Sessions are taken in order of (new tokens, length), at most
        `max_batch` per group.
        """
        new = list(new_tokens) if new_tokens is not None else [0] * len(lengths)
        order = sorted(range(len(lengths)), key=lambda i: (new[i], lengths[i]))
        limit = self.max_bytes // max(1, self._bytes_per_token()) if self.max_bytes else 0
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            fits = (
                g is not None
                and len(g) < max_batch
                and new[i] <= 2 * new[g[0]] + 16  # sorted: g[0] has the fewest new tokens
                and (not limit or (len(g) + 1) * max(lengths[i], max(lengths[j] for j in g)) <= limit)
            )
            if fits:
                assert g is not None
                g.append(i)
            else:
                groups.append([i])
        return groups


class SessionTable(Generic[T]):
    """Session ID -> state, with an admission limit and idle expiry.

    Not thread-safe on purpose: each engine touches its table from one thread.
    """

    def __init__(
        self,
        max_sessions: int,
        *,
        idle_timeout_s: float = 600.0,
        on_evict: Callable[[str, T], None] | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._entries: dict[str, _Entry[T]] = {}
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __iter__(self) -> Iterator[tuple[str, T]]:
        return ((sid, e.value) for sid, e in self._entries.items())

    def put(self, session_id: str, value: T) -> None:
        """Add or replace a session; ResourceExhausted when the table is full."""
        old = self._entries.pop(session_id, None)
        if old is not None and self._on_evict is not None:
            self._on_evict(session_id, old.value)
        self.expire_idle()
        if len(self._entries) >= self.max_sessions:
            raise ResourceExhausted(
                f"session limit reached ({self.max_sessions} active); retry later or raise --max-sessions"
            )
        self._entries[session_id] = _Entry(value)

    def get(self, session_id: str) -> T:
        entry = self._entries.get(session_id)
        if entry is None:
            raise SessionNotFound(f"unknown session {session_id!r}; open it first")
        entry.last_used = time.monotonic()
        return entry.value

    def pop(self, session_id: str) -> T | None:
        entry = self._entries.pop(session_id, None)
        return None if entry is None else entry.value

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Drop sessions unused for idle_timeout_s; return their IDs."""
        now = time.monotonic() if now is None else now
        expired = [sid for sid, e in self._entries.items() if now - e.last_used > self.idle_timeout_s]
        for sid in expired:
            entry = self._entries.pop(sid)
            if self._on_evict is not None:
                self._on_evict(sid, entry.value)
        return expired
