"""SimRunner: the CausalLMRunner interface over an emulated accelerator.

The drafter and the verifier call a runner: sessions of token ids with a
rollback-able "KV cache", `logits` / `logits_batch` for the last rows of
each. SimRunner keeps exactly that bookkeeping (it inherits session edits,
validation and the `cached` prefix from CausalLMRunner, with an empty
cache), but a forward pass neither runs a model nor holds a core:

- the logits come from `SimLM` (an exact function of each row's context);
- the pass takes the wall time the profile's `CostModel` gives for the
  batch (positions recomputed per session, their lengths), measured from
  the start of the call; it sleeps first (time.sleep releases the GIL), so
  several emulated services on a couple of cores behave like several
  accelerators, and computes the logits last, in the time they are expected
  to take before the pass ends (a pass writes its logits at its end, and the
  caller's sampling after it then runs warm). The sleep ends early by the
  recent wake-up delay of this thread (on a loaded host a sleeper is woken
  late) and a short remainder is spun, so passes end on time.

A pass whose own compute outlasts its modelled time is late; `stats`
counts those, so a report can say when the host could not keep up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.lm import SimLM
from specd.core.model.tree_forward import TreeLogits, check_trees
from specd.core.sampling.tree import DraftTree

__all__ = ["SimRunner", "SimStats"]

_LATE_SLACK_MS = 0.5  # a pass this much past its modelled time counts as late
_OVERSLEEP_ALPHA = 0.2  # weight of the latest wake-up delay in its running estimate
_OVERSLEEP_MAX = 0.010  # s: never wake more than this much early
_SPIN_S = 0.0003  # s: a pass this close to its end spins rather than sleeps (a wake-up is ~0.1 ms late here)
_SPIN_READS = 100_000  # clock reads a spin makes at most (a clock that does not move: tests)
_LOGITS_ALPHA = 0.2  # weight of the latest pass in the running estimate of the logits' time per row


@dataclass
class SimStats:
    """What the emulated accelerator did (read by tests and reports)."""

    forwards: int = 0  # passes run
    modelled_ms: float = 0.0  # sum of their modelled durations
    wall_ms: float = 0.0  # sum of their actual durations
    late: int = 0  # passes whose host-side compute took longer than their modelled time
    late_ms: float = 0.0  # total time past the modelled durations
    positions: int = 0  # positions run (prefill, decode and verify tokens)
    rows: int = 0  # logit rows returned


class SimRunner(CausalLMRunner):
    """CausalLMRunner over an emulated model: same sessions and rollback, p from SimLM, time from CostModel.

    Not thread-safe (like CausalLMRunner: the service's single model thread calls it).
    """

    def __init__(
        self,
        lm: SimLM,
        cost: CostModel,
        *,
        max_context: int,
        kv_bytes_per_token: int,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        # No model: CausalLMRunner.__init__ inspects one, so set its attributes here.
        if max_context < 2:
            raise InvalidArgument(f"max_context must be >= 2, got {max_context}")
        if kv_bytes_per_token < 0:
            raise InvalidArgument(f"kv_bytes_per_token must be >= 0, got {kv_bytes_per_token}")
        self.lm = lm
        self.cost = cost
        self.vocab_size = lm.vocab_size
        self.max_context = int(max_context)
        self._sim_kv_bytes = int(kv_bytes_per_token)
        self._clock = clock
        self._sleep = sleep
        self._oversleep = 0.0  # s: running estimate of how late sleep() returns here
        self._logits_s_per_row = 0.0  # s: running estimate of SimLM's compute per logits row, after a sleep
        self._stats_lock = threading.Lock()  # stats are read from other threads (metrics, tests)
        self.stats = SimStats()

    # ---- forward ---------------------------------------------------------

    def logits(self, s: KVSession, num_last: int = 1) -> Tensor:
        """Logits of the last `num_last` positions -> [num_last, V] float32, after the modelled time."""
        n = len(s.tokens)
        if isinstance(num_last, bool) or not isinstance(num_last, int) or not 1 <= num_last <= n:
            raise InvalidArgument(f"num_last must be an int in [1, {n}] (the sequence length), got {num_last!r}")
        return self._forward([(s, num_last)])[0]

    def logits_batch(
        self, sessions: Sequence[KVSession], num_last: Sequence[int], *, beside: Callable[[], None] | None = None
    ) -> list[Tensor]:
        """`logits(sessions[b], num_last[b])` for every b, as ONE emulated pass (batch-aware cost).

        beside: host work that needs nothing of this pass, run while it runs (as beside an
        accelerator's asynchronous pass): it takes its time out of the modelled wait."""
        pairs = self._check_batch(sessions, num_last)
        return self._forward(pairs, beside) if pairs else []

    def _forward(self, pairs: list[tuple[KVSession, int]], beside: Callable[[], None] | None = None) -> list[Tensor]:
        started = self._clock()
        if beside is not None:
            beside()
        # Positions [start_b, n_b) run, as in CausalLMRunner: the uncached ones, or
        # at least the num_last rows returned (recomputed after a rollback).
        news, lengths, contexts = [], [], []
        for s, k in pairs:
            n = len(s.tokens)
            start = min(s.cached, n - k)
            news.append(n - start)
            lengths.append(n)
            for i in range(k):  # row i predicts token n - k + i + 1: its context ends there
                contexts.append(self._context(s.tokens, n - k + i + 1))
        logits = self._timed(started, news, lengths, contexts)
        for s, _ in pairs:
            s.cached = len(s.tokens)
        return list(logits.split([k for _, k in pairs]))

    def tree_logits_batch(self, sessions: Sequence[KVSession], trees: Sequence[DraftTree]) -> list[TreeLogits]:
        """CausalLMRunner.tree_logits_batch as ONE emulated pass: a tree costs its node count.

        Session b runs its uncached committed tokens and its N_b nodes (new positions
        m_b + N_b), and each node attends over the prefix and its ancestors; the cost
        model charges the pass as it would a chain of the same number of positions
        (sum_b (c_b + n_b) stays the KV read: per node, prefix plus its path at most).
        Row 0 follows the last token; row 1 + i sees the prefix and node i's path.
        """
        started = self._clock()
        check_trees(sessions, trees, self.vocab_size, self.max_context)
        news, lengths, contexts = [], [], []
        for s, t in zip(sessions, trees):
            n = len(s.tokens)
            news.append(n - min(s.cached, n - 1) + len(t))
            lengths.append(n + len(t))
            contexts.append(self._context(s.tokens, n))
            for i in range(len(t)):  # node i's context: the prefix, then its path
                contexts.append(self._context(s.tokens, n, [t.token_ids[j] for j in t.path_to(i)]))
        logits = self._timed(started, news, lengths, contexts) if sessions else torch.zeros(0, self.vocab_size)
        for s in sessions:
            s.cached = len(s.tokens)
        chunks = logits.split([len(t) + 1 for t in trees])
        return [TreeLogits(c, t, len(s.tokens), None) for c, t, s in zip(chunks, trees, sessions)]

    def _context(self, tokens: list[int], end: int, extra: Sequence[int] = ()) -> list[int]:
        """The last tokens of tokens[:end] + extra that p reads (SimShape.context_tokens), copying only those."""
        width = self.lm.shape.context_tokens
        head = tokens[max(0, end - max(0, width - len(extra))) : end]
        return (head + list(extra))[-width:] if width else []

    def _timed(self, started: float, news: list[int], lengths: list[int], contexts: list[list[int]]) -> Tensor:
        """SimLM's logits for `contexts` -> [R, V], returned `started` + the pass's modelled time.

        The logits come last, as an accelerator's pass writes them at its end: the pass sleeps
        first and computes them in the time it expects them to take before its end. On a shared
        host a thread that slept for milliseconds runs its next work several times slower (0.16-0.23
        against 0.04 ms for a greedy step's sampling after a 5 ms sleep, scripts/idle_wake_cost.py,
        docs/performance.md); computing the logits after the sleep warms that path for the
        caller's own work after the pass (sampling), as it is warm beside a real accelerator.
        """
        modelled_ms = self.cost.forward_ms(news, lengths)
        deadline = started + modelled_ms / 1e3
        self._sleep_toward(deadline - len(contexts) * self._logits_s_per_row)
        before = self._clock()
        logits = self.lm.logits(contexts)  # [R, V]
        took = self._clock() - before
        per_row = took / max(1, len(contexts))
        self._logits_s_per_row = _LOGITS_ALPHA * per_row + (1 - _LOGITS_ALPHA) * self._logits_s_per_row
        self._finish_at(deadline)
        wall_ms = (self._clock() - started) * 1e3
        with self._stats_lock:
            st = self.stats
            st.forwards += 1
            st.modelled_ms += modelled_ms
            st.wall_ms += wall_ms
            st.positions += sum(news)
            st.rows += len(contexts)
            if wall_ms > modelled_ms + _LATE_SLACK_MS:
                st.late += 1
                st.late_ms += wall_ms - modelled_ms
        return logits

    def _finish_at(self, deadline: float) -> None:
        """Return at `deadline`, not before: spin through a remainder shorter than a wake-up would oversleep
        (the logits' time varies by about that much), sleep a longer one."""
        for _ in range(_SPIN_READS):
            left = deadline - self._clock()
            if left <= 0:
                return
            if left > _SPIN_S:
                break
        self._wait_until(deadline)

    def _sleep_toward(self, until: float) -> None:
        """One sleep that ends near `until` on average: early by the recent wake-up delay, which it measures."""
        now = self._clock()
        wanted = until - now - self._oversleep
        if wanted <= 0:
            return
        self._sleep(wanted)
        self._measure_wake(now, wanted)

    def _measure_wake(self, slept_at: float, wanted: float) -> None:
        """Fold how late a sleep of `wanted` s from `slept_at` woke into the running estimate."""
        late_by = max(0.0, self._clock() - slept_at - wanted)
        self._oversleep = min(_OVERSLEEP_ALPHA * late_by + (1 - _OVERSLEEP_ALPHA) * self._oversleep, _OVERSLEEP_MAX)

    def _wait_until(self, deadline: float) -> None:
        """Sleep until `deadline`, never returning before it.

        On a loaded host a sleeping thread is woken late (run-queue wait), so the first sleep ends
        early by the recent oversleep and a second one sleeps what is left. Every wait measures a
        sleep's lateness, so the estimate follows the host: before, a pass shorter than the estimate
        skipped its sleep, ended early and measured nothing, so one late wake-up (up to the 10 ms
        cap) could make every later short pass end early for the rest of the process (an emulated
        8B draft pass of 1.75 ms then cost nothing).
        """
        now = self._clock()
        if deadline <= now:
            return
        first = deadline - now - self._oversleep
        if first <= 0:  # the whole wait is within the estimate: one sleep, measured
            first = deadline - now
        self._sleep(first)
        self._measure_wake(now, first)
        woke = self._clock()
        if woke < deadline:  # woke early by design: the rest
            self._sleep(deadline - woke)

    # ---- memory ------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The host: an emulated model holds no device memory (its p is computed on the CPU)."""
        return torch.device("cpu")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes the emulated model holds per cached token (the profile's figure)."""
        return self._sim_kv_bytes

    def kv_bytes(self, s: KVSession) -> int:  # type: ignore[override]  # an instance method here: it needs the profile
        return s.cached * self._sim_kv_bytes

    def release(self, s: KVSession) -> None:
        """Nothing to free: the session holds no tensors."""

    def snapshot(self) -> SimStats:
        """A copy of the stats, consistent at one instant."""
        with self._stats_lock:
            return SimStats(**vars(self.stats))
