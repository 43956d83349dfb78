"""Round overhead per cell, from the coordinator's own histogram of it.

The coordinator observes every round's time split into draft compute,
target compute and overhead (the rest: network, queues, event-loop and
thread hops; metric specd:round_seconds{part="overhead"}). The bench starts
the coordinator with a metrics port, reads the histogram before and after
each mode's requests, and turns the difference into p50 / p99 the way
Prometheus' histogram_quantile does (linear within a bucket), so the
figures are as fine as the histogram's buckets (every 0.1 ms up to 0.5 ms,
then 0.75, 1, 1.5, 2, 3, 5, 10, 25 ms, ...). Services the bench did not
start (--address) give none.
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from specd.serving.metrics import PREFIX

_METRICS_LINE = re.compile(r"^specd-coordinator metrics on (\S+):(\d+)\s*$")
_FAMILY = PREFIX + "round_seconds"
_PART = "overhead"

Buckets = dict[float, float]  # upper bound (s, inf last) -> cumulative count


def metrics_address(lines: Sequence[str]) -> str | None:
    """HOST:PORT of the coordinator's metrics endpoint, from its start-up lines (None: not enabled)."""
    for line in lines:
        if m := _METRICS_LINE.match(line):
            return f"{m.group(1)}:{m.group(2)}"
    return None


def read_overhead(address: str, timeout_s: float = 10.0) -> Buckets:
    """The overhead histogram's cumulative bucket counts now."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s).read().decode()
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != _FAMILY:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("part") == _PART:
                out[float(s.labels["le"])] = float(s.value)
    return dict(sorted(out.items()))


def difference(after: Buckets, before: Buckets) -> Buckets:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def add(a: Buckets, b: Buckets) -> Buckets:
    return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in sorted(set(a) | set(b))}


def quantile_ms(buckets: Mapping[float, float], q: float) -> float | None:
    """The q-quantile in ms of a cumulative histogram (histogram_quantile's interpolation); None if empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower * 1e3  # past the last finite bound: that bound is all we know
            inside = count - below
            frac = (rank - below) / inside if inside > 0 else 1.0
            return (lower + (le - lower) * frac) * 1e3
        lower, below = le, count
    return lower * 1e3
