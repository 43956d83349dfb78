"""Per-session state of the draft and target engines: one session pool, shared by both.

SessionTable bounds how many sessions there are (and expires idle ones);
KVBudget bounds the KV-cache memory they hold and splits a batch into
forward passes; KVSessionPool puts the two together for sessions that own a
KV cache and runs the skeleton of a batched step: per-request checks, the
step's growth checked against the budget, forward groups, a failed group
rolled back. PooledModel is the base of the engines built on one
(ModelDrafter, Verifier).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypedDict, TypeVar, Unpack

import torch

from specd.core import phases as ph
from specd.core.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.phases import PhaseLog

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    value: T
    last_used: float = field(default_factory=time.monotonic)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failed: torch.OutOfMemoryError (CUDA and other accelerators), MemoryError, or the
    RuntimeError torch's CPU allocator raises ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def out_of_memory_error(exc: BaseException) -> ResourceExhausted:
    """What a request whose step ran out of memory even alone hears (the allocator's first line, shortened)."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return ResourceExhausted(
        f"out of memory for this request: its step did not fit in the memory left beside the other sessions, "
        f"even alone ({detail}); retry it later or with a shorter prompt, or give the service more memory "
        "or a smaller --max-kv-bytes"
    )


class KVBudget:
    """KV-cache memory in tokens: a session is admitted if all held tokens plus its own fit, and a
    step may grow a session only if the tokens it adds fit too (KVSessionPool.run_batch).

    Counted in tokens of the sequences (cached or not yet), which bound the
    bytes the caches hold: held bytes <= held tokens x bytes per token.
    """

    def __init__(self, max_bytes: int, bytes_per_token: Callable[[], int]) -> None:
        self.max_bytes = max_bytes
        self._bytes_per_token = bytes_per_token

    def max_tokens(self) -> int:
        """Tokens the budget holds (0: no limit)."""
        return self.max_bytes // max(1, self._bytes_per_token()) if self.max_bytes else 0

    def admit(self, held_tokens: int, new_tokens: int) -> None:
        if not self.max_bytes:
            return
        per_token = self._bytes_per_token()
        needed = (held_tokens + new_tokens) * per_token
        if needed > self.max_bytes:
            raise ResourceExhausted(
                f"KV-cache budget reached: {held_tokens} tokens held + {new_tokens} new need {needed} bytes, "
                f"the budget is {self.max_bytes} bytes (--max-kv-bytes); retry later, or raise --max-kv-bytes"
            )

    def refuse_growth(self, held_tokens: int, growth: int) -> ResourceExhausted:
        """The error of a step that would grow its session by `growth` tokens beside `held_tokens` (held or reserved)."""
        per_token = self._bytes_per_token()
        return ResourceExhausted(
            f"KV-cache budget reached: this step would add {growth} tokens ({growth * per_token} bytes) to the "
            f"request's session beside {held_tokens} tokens ({held_tokens * per_token} bytes) held by all sessions; "
            f"the budget is {self.max_bytes} bytes (--max-kv-bytes). Retry the request later, or raise --max-kv-bytes"
        )

    def refuse_prefix(self, held_tokens: int, committed: int) -> ResourceExhausted:
        """The error of a session whose committed prefix itself no longer fits (its cache is dropped)."""
        per_token = self._bytes_per_token()
        return ResourceExhausted(
            f"KV-cache budget reached: the {committed} committed tokens of the request's session no longer fit "
            f"beside {held_tokens} tokens held ({held_tokens * per_token} bytes); the budget is {self.max_bytes} "
            "bytes (--max-kv-bytes), so the session was dropped. Retry the request later, or raise --max-kv-bytes"
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
        limit = self.max_tokens()
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


class HasKV(Protocol):
    """A session's state that owns a KV cache (kv.tokens: the session's sequence)."""

    @property
    def kv(self) -> KVSession: ...


class StepRequest(Protocol):
    """What a batched step needs of each request: whose session, and its committed prefix."""

    @property
    def session_id(self) -> str: ...

    @property
    def committed_length(self) -> int: ...


S = TypeVar("S", bound=HasKV)
R = TypeVar("R", bound=StepRequest)


@dataclass(frozen=True)
class Ready(Generic[S]):
    """A request that passed its checks and reaches the forward pass."""

    index: int  # its place in the batch
    session: S
    extra: int = 0  # positions the step will still add to the cache (a drafter's tokens to draft)
    length: int = 0  # the session's tokens after its checks: where a retried group starts again


@dataclass
class BatchRun(Generic[S]):
    """A batched step's bookkeeping: per request its error (None: fine so far) and its phase log."""

    errors: list[Exception | None]
    logs: list[PhaseLog]
    ready: list[Ready[S]] = field(default_factory=list)


class KVSessionPool(Generic[S]):
    """The sessions of one model (a drafter's or the verifier's), each owning a KV cache of `runner`.

    Admission by count (max_sessions) and by KV memory (max_kv_bytes, 0: no
    limit), at open and again whenever a step grows sessions (run_batch); a
    session's cache is released when it is closed, re-opened or expires.
    `held(session)` is the tokens a session holds (its sequence; a drafter adds
    its branches). Not thread-safe on purpose: an engine touches it from its
    model thread only.
    """

    def __init__(
        self,
        runner: CausalLMRunner,
        *,
        max_sessions: int = 256,
        idle_timeout_s: float = 600.0,
        max_kv_bytes: int = 0,
        max_batch: int = 32,
        held: Callable[[S], int] | None = None,
    ) -> None:
        if max_batch < 1:
            raise InvalidArgument(f"max_batch must be >= 1 (got {max_batch})")
        self.runner = runner
        self.max_batch = max_batch
        self.budget = KVBudget(max_kv_bytes, lambda: runner.kv_bytes_per_token)
        self._held: Callable[[S], int] = held if held is not None else (lambda s: len(s.kv))
        self._table: SessionTable[S] = SessionTable(
            max_sessions, idle_timeout_s=idle_timeout_s, on_evict=lambda _sid, s: runner.release(s.kv)
        )
        # During a step: the lengths its admitted sequences may reach (id(kv) -> (kv, tokens)).
        self._planned: dict[int, tuple[KVSession, int]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def held_tokens(self) -> int:
        """Tokens every session holds now (cached or still to be computed)."""
        return sum(self._held(s) for _, s in self._table)

    def reserved_tokens(self) -> int:
        """Tokens the step under way was granted but has not added yet (0 between steps)."""
        return sum(max(0, n - len(kv)) for kv, n in self._planned.values())

    def reserve(self, kv: KVSession, length: int) -> None:
        """Count `kv` (a sequence made during a step, e.g. a drafter's branch) at `length` tokens until the step ends."""
        self._planned[id(kv)] = (kv, length)

    def open(self, session_id: str, token_ids: Sequence[int], make: Callable[[KVSession], S]) -> S:
        """A new session over `token_ids` (a re-open replaces the session and its memory); `make` wraps its cache."""
        self.close(session_id)
        self.budget.admit(self.held_tokens(), len(token_ids))
        session = make(self.runner.new_session(token_ids))
        self._table.put(session_id, session)
        return session

    def close(self, session_id: str) -> None:
        session = self._table.pop(session_id)
        if session is not None:
            self.runner.release(session.kv)

    def get(self, session_id: str) -> S:
        """The session (SessionNotFound if there is none); marks it used."""
        return self._table.get(session_id)

    def kv_bytes(self) -> int:
        return sum(self.runner.kv_bytes(s.kv) for _, s in self._table)

    def values(self) -> Iterator[S]:
        """The sessions' states (no use marked)."""
        return (s for _, s in self._table)

    def run_batch(
        self,
        requests: Sequence[R],
        prepare: Callable[[R], tuple[S, int]],
        run_group: Callable[[list[Ready[S]], BatchRun[S]], dict[int, Exception]],
        *,
        what: str,
        growth: Callable[[R, Ready[S]], int] | None = None,
    ) -> BatchRun[S]:
        """The skeleton of a batched step over many sessions.

        prepare(request), timed as the SYNC phase: the request's own checks
        and sync; returns its session and the positions the step will add.
        A request that fails them gets its exception and leaves the others
        alone. growth(request, ready): the tokens the step may still add to
        the session's sequence after prepare (default: ready.extra); with a
        KV budget, the requests whose growth does not fit are shed alone
        (_admit_growth). The rest run in forward groups (KVBudget's split);
        run_group(group, run) runs one and returns {index: error} for
        requests that failed alone. A failed request, or every request of a
        group whose run raised, is rolled back to its committed prefix; a
        group that ran out of memory is split and run again first
        (_run_group), so only a session that cannot run alone fails.
        """
        run: BatchRun[S] = BatchRun([None] * len(requests), [PhaseLog() for _ in requests])
        seen: set[str] = set()
        for i, req in enumerate(requests):
            try:
                if req.session_id in seen:
                    raise InvalidArgument(f"session {req.session_id!r} appears twice in one {what} batch")
                seen.add(req.session_id)
                with run.logs[i].phase(ph.SYNC):
                    session, extra = prepare(req)
                run.ready.append(Ready(i, session, extra, len(session.kv)))
            except Exception as exc:  # noqa: BLE001 - this request's error, reported in its slot
                run.errors[i] = exc
        try:
            self._admit_growth(requests, run, growth or (lambda _req, r: r.extra))
            ready = run.ready
            groups = self.budget.forward_groups(
                [len(r.session.kv) + r.extra for r in ready],  # lengths at the end of the step bound its padded copy
                self.max_batch,
                [len(r.session.kv) - r.session.kv.cached for r in ready],
            )
            for group in groups:
                self._run_group([ready[g] for g in group], requests, run_group, run)
        finally:
            self._planned.clear()
        return run

    def _run_group(
        self,
        part: list[Ready[S]],
        requests: Sequence[R],
        run_group: Callable[[list[Ready[S]], BatchRun[S]], dict[int, Exception]],
        run: BatchRun[S],
    ) -> None:
        """Run one forward group and roll back the requests that failed.

        Out of memory in a group of several: the group is rolled back to where
        its checks left it and each half runs on its own (recursively), so
        only a session that cannot run even alone fails, with
        ResourceExhausted. Any other error of the shared run fails every
        request in it, as before.
        """
        try:
            failed = run_group(part, run)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: every request in it fails
            if is_out_of_memory(exc):
                if len(part) > 1:
                    for r in part:  # back to the state after prepare (a drafter may have drafted some tokens)
                        self.runner.truncate(r.session.kv, r.length)
                    half = len(part) // 2
                    self._run_group(part[:half], requests, run_group, run)
                    self._run_group(part[half:], requests, run_group, run)
                    return
                exc = out_of_memory_error(exc)
            failed = {r.index: exc for r in part}
        for r in part:
            if r.index in failed:
                self._planned.pop(id(r.session.kv), None)
                self.runner.truncate(r.session.kv, requests[r.index].committed_length)
                run.errors[r.index] = failed[r.index]
            run.logs[r.index].batch_size = len(part)

    def _admit_growth(self, requests: Sequence[R], run: BatchRun[S], growth: Callable[[R, Ready[S]], int]) -> None:
        """Keep the step's sessions within the KV budget; shed (ResourceExhausted) the ones that do not fit.

        Sessions not in the step count at what they hold; a stepping one at its
        committed prefix, which it keeps whatever happens (a shed step is rolled
        back to it). Then each stepping session asks for its growth: the
        tokens past its committed prefix the step may leave it holding
        (the drafts it verifies or drafts, plus the one token the verdict or
        the next sync adds).

        Who is shed when several grow at once: the youngest sessions (opened
        last), as vLLM preempts the request that arrived last. Growth is
        granted oldest first while it fits; a session whose growth does not
        fit next to the grants before it is shed alone and keeps its
        committed prefix. An older session has more of its work held, and a
        young one retried (later, or on another replica) loses least; a
        session that is not stepping is never shed to make room. Only if the
        committed prefixes themselves overflow (a sync brought tokens no step
        was granted, e.g. after target-only rounds) are the youngest stepping
        sessions dropped whole until they fit.
        """
        if not self.budget.max_bytes or not run.ready:
            return
        limit = self.budget.max_tokens()
        stepping = {id(r.session) for r in run.ready}
        age = {id(s): n for n, (_, s) in enumerate(self._table)}  # the table keeps open order
        order = sorted(run.ready, key=lambda r: age[id(r.session)])  # oldest first
        committed = {r.index: requests[r.index].committed_length for r in order}
        total = sum(self._held(s) for _, s in self._table if id(s) not in stepping) + sum(committed.values())
        shed: set[int] = set()
        for r in reversed(order):  # the youngest first, while the prefixes overflow
            if total <= limit:
                break
            total -= committed[r.index]
            run.errors[r.index] = self.budget.refuse_prefix(total, committed[r.index])
            self.close(requests[r.index].session_id)
            shed.add(r.index)
        for r in order:
            if r.index in shed:
                continue
            grow = len(r.session.kv) + growth(requests[r.index], r) - committed[r.index]
            if total + grow <= limit:
                total += grow
                self._planned[id(r.session.kv)] = (r.session.kv, committed[r.index] + grow)
                continue
            run.errors[r.index] = self.budget.refuse_growth(total, grow)
            self.runner.truncate(r.session.kv, committed[r.index])
            shed.add(r.index)
        run.ready = [r for r in run.ready if r.index not in shed]


class PoolLimits(TypedDict, total=False):
    """KVSessionPool's limits, as keyword arguments of the engines built on one."""

    max_sessions: int
    idle_timeout_s: float
    max_kv_bytes: int
    max_batch: int


class PooledModel(Generic[S]):
    """Base of the engines whose sessions own KV caches of one model: ModelDrafter, Verifier."""

    def __init__(self, runner: CausalLMRunner, **limits: Unpack[PoolLimits]) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self._pool: KVSessionPool[S] = KVSessionPool(runner, held=self._held_tokens, **limits)

    def _held_tokens(self, session: S) -> int:
        """Tokens a session holds in KV memory: its sequence (a drafter adds its branches)."""
        return len(session.kv)

    def close(self, session_id: str) -> None:
        self._pool.close(session_id)

    def active_sessions(self) -> int:
        return len(self._pool)

    def kv_bytes(self) -> int:
        return self._pool.kv_bytes()
