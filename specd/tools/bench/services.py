"""The specd modes' runner: requests over the Coordinator API, one client thread per concurrent client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coordinator.client import CoordinatorClient
from specd.tools.bench.modes import Mode
from specd.tools.bench.prompts import BenchPrompt
from specd.tools.bench.results import RequestResult, Timeline

_STATS_FIELDS = (
    "rounds",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "completion_tokens",
    "target_only_rounds",
    "pipeline_hits",
    "time_to_first_token_ms",
    "tokens_per_s",
)


def _stats_dict(stats: Any) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(stats, k) for k in _STATS_FIELDS if hasattr(stats, k)}
    if "accepted_per_position" in stats.DESCRIPTOR.fields_by_name:  # once the API carries it
        out["accepted_per_position"] = list(stats.accepted_per_position)
    if "pipeline_hits_by_outcome" in stats.DESCRIPTOR.fields_by_name:
        out["pipeline_hits_by_outcome"] = dict(stats.pipeline_hits_by_outcome)
    return out


def run_service_request(
    client: Any, prompt_id: str, ids: list[int], options: Mapping[str, Any], metadata: Sequence[tuple[str, str]] = ()
) -> RequestResult:
    """One GenerateStream call, timed per message (one message per round)."""
    r = RequestResult(prompt_id)
    r.start = time.perf_counter()
    timeline = Timeline(r)
    try:
        for msg in client.generate_stream(ids, metadata=metadata, **options):
            timeline.add(time.perf_counter(), len(msg.token_ids))
            r.token_ids.extend(int(t) for t in msg.token_ids)
            if msg.HasField("stats"):
                r.stats = _stats_dict(msg.stats)
    except Exception as exc:  # noqa: BLE001 - counted and reported; the run goes on
        r.error = f"{type(exc).__name__}: {getattr(exc, 'details', lambda: '')() or exc}"
    r.end = time.perf_counter()
    return r


def run_service_cell(
    address: str,
    mode: Mode,
    items: Sequence[tuple[BenchPrompt, list[int]]],
    *,
    temperature: float,
    concurrency: int,
    max_new_tokens: int,
    seed: int,
    ignore_eos: bool,
    timeout: float,
    bar: Any,
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
    cache_salt: str = "",
) -> tuple[list[RequestResult], float]:
    """cache_salt: the cell's tenant (a learning draft learns from the cell's own requests only)."""
    options = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        cache_salt=cache_salt,
        **mode.request,
    )
    # A caller's seed pins auto's K (the output must reproduce; docs/performance.md), so auto modes
    # run unseeded, as a caller who sets none: what auto reaches there is what auto is.
    seeded = mode.request.get("speculation") != "auto"
    local = threading.local()
    clients: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> RequestResult:
        if not hasattr(local, "client"):  # one channel per client thread, as separate clients would have
            local.client = CoordinatorClient(address, timeout=timeout)
            with lock:
                clients.append(local.client)
        p, ids = items[i]
        request = dict(options, seed=seed + i) if seeded else options
        r = run_service_request(local.client, p.id, ids, request, metadata())
        bar.update(1)
        return r

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-client")
    try:
        start = time.perf_counter()
        results = list(pool.map(one, range(len(items))))
        wall = time.perf_counter() - start
    finally:
        with lock:
            for c in clients:
                c.close()  # on an interrupt this cancels the streams in flight, so the pool ends at once
        pool.shutdown(wait=True, cancel_futures=True)
    return results, wall
