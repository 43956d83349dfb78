"""The coordinator's view of each draft and target replica, as Prometheus metrics.

Read at scrape time from the replica sets (coordinator/replicas.py), so a
replica that leaves stops being exported. Labels: role (draft | target),
replica (its address). This coordinator's counts; the replicas' own
metrics (specd:sessions_active, specd:kv_cache_bytes) give their totals.

    specd:replica_sessions{role, replica}           sessions this coordinator has there
    specd:replica_load{role, replica}               sessions + queued steps it reports (+ ours since)
    specd:replica_kv_cache_bytes{role, replica}     KV bytes it reports
    specd:replica_state{role, replica, state}       1 for its state (serving, draining, retiring, unfit, down, starting)
    specd:replica_placements_total{role, replica}   sessions opened there (new, or moved from another)
    specd:replica_session_moves_total{role}         sessions rebuilt on another replica
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "specd:"
STATES = ("serving", "draining", "retiring", "unfit", "down", "starting")

# Per role: (its replicas' rows as ReplicaSet.describe() gives them, sessions moved so far).
Snapshot = Callable[[], Sequence[tuple[str, Sequence[dict[str, Any]], int]]]


class ReplicaCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "replica"]
        sessions = GaugeMetricFamily(
            PREFIX + "replica_sessions", "Sessions this coordinator holds on the replica.", labels=labels
        )
        load = GaugeMetricFamily(
            PREFIX + "replica_load", "Sessions plus queued steps the replica reports (with ours since).", labels=labels
        )
        kv = GaugeMetricFamily(PREFIX + "replica_kv_cache_bytes", "KV-cache bytes the replica reports.", labels=labels)
        state = GaugeMetricFamily(
            PREFIX + "replica_state",
            "1 for the replica's state as this coordinator sees it.",
            labels=[*labels, "state"],
        )
        placements = CounterMetricFamily(
            PREFIX + "replica_placements", "Sessions opened on the replica (new or moved).", labels=labels
        )
        moves = CounterMetricFamily(
            PREFIX + "replica_session_moves",
            "Sessions rebuilt on another replica (theirs left, drained or failed).",
            labels=["role"],
        )
        for role, rows, moved in self._snapshot():
            moves.add_metric([role], moved)
            for row in rows:
                key = [role, row["replica"]]
                sessions.add_metric(key, row["sessions"])
                load.add_metric(key, row["load"])
                kv.add_metric(key, row["kv_bytes"])
                placements.add_metric(key, row["placements"])
                for s in STATES:
                    state.add_metric([*key, s], 1.0 if row["state"] == s else 0.0)
        yield from (sessions, load, kv, state, placements, moves)
