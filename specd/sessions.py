"""A bounded table of per-session state, shared by the draft and target engines."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specd.errors import ResourceExhausted, SessionNotFound

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

    def forward_groups(self, lengths: Sequence[int], max_batch: int) -> list[list[int]]:
        """Split a batch (indices into `lengths`, session lengths) into forward passes.

        A batched forward copies its sessions' caches into one padded tensor:
        n sessions of at most L tokens hold n x L positions more for the pass.
        Groups are formed shortest-first (similar lengths pad least), at most
        `max_batch` sessions each, and with a budget each group's padded copy
        stays within max_bytes, so a step never needs more than twice the
        budget (the admitted sessions plus one pass's copy).
        """
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        limit = self.max_bytes // max(1, self._bytes_per_token()) if self.max_bytes else 0
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            # Sorted ascending, so the newcomer is the group's longest.
            if g is not None and len(g) < max_batch and (not limit or (len(g) + 1) * lengths[i] <= limit):
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
                f"session limit reached ({self.max_sessions} active); retry later "
                "or raise --max-sessions"
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
