"""The measured cells: every (temperature, clients, mode), modes taking turns over slices of the prompts."""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordinator.client import CoordinatorClient
from specd.tools.bench.console import progress, say
from specd.tools.bench.hf_baseline import HFBaseline
from specd.tools.bench.learning import per_request
from specd.tools.bench.modes import Mode
from specd.tools.bench.overhead import Buckets, add, difference, quantile_ms
from specd.tools.bench.plan import BenchError, Plan, interleave_slices
from specd.tools.bench.prompts import BenchPrompt
from specd.tools.bench.records import summarize
from specd.tools.bench.results import RequestResult
from specd.tools.bench.services import run_service_cell, run_service_request


def warm_up_requests(plan: Plan, modes: Sequence[Mode]) -> list[tuple[Mode, dict[str, Any]]]:
    """The warm-up's requests: every service mode once at each temperature of the plan (greedy first), short.

    Each temperature: a sampled request's path (processed p, sparse q, the draws) has first-use
    costs of its own, and auto measures greedy and sampled rounds as separate classes
    (specd.core.rounds.auto), so a T > 0 cell after a greedy-only warm-up paid both in its first
    requests, which a server that has been running does not (issue 30's grid at agreement 0.8,
    two alternated pairs, emulated: auto / best fixed at T = 0.7 0.945 / 0.967 -> 1.000 / 1.059 on
    h100-tp2-70b, 0.987 / 0.882 -> 0.948 / 0.967 on h100-8b)."""
    short = dict(max_new_tokens=min(8, plan.max_new_tokens), ignore_eos=True)
    return [
        (m, {**short, "temperature": temperature, **m.request})
        for temperature in dict.fromkeys([0.0, *plan.temperatures])
        for m in modes
        if not m.hf_baseline
    ]


def warm_up(
    args: argparse.Namespace,
    plan: Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    hf_baseline: HFBaseline | None,
    quiet: bool,
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
) -> None:
    """Every mode once per temperature (`warm_up_requests`), short, not measured."""
    say("warming up ...", quiet)
    with CoordinatorClient(address, timeout=args.timeout) as client:
        for m, request in warm_up_requests(plan, modes):
            r = run_service_request(client, "warmup", items[0][1], request, metadata())
            if r.error:
                raise BenchError(
                    f"mode {m.name} fails on its warm-up request at T = {request['temperature']:g}: {r.error}"
                )
    if hf_baseline is not None:
        for m in modes:
            if m.hf_baseline:
                hf_baseline.configure(m)
                hf_baseline.run("warmup", items[0][1], m, temperature=0.0, seed=0, max_new_tokens=4, stop_at_eos=False)


def run_cells(
    args: argparse.Namespace,
    plan: Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    hf_baseline: HFBaseline | None,
    cost: Mapping[str, Any],
    records: list[dict[str, Any]],
    outputs: dict[tuple[str, str, float, int], dict[str, list[int]]],
    quiet: bool,
    services: str = "",
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
    before_mode: Callable[[Mode], None] | None = None,
    overhead: Callable[[], Buckets] | None = None,
) -> None:
    """Every (temperature, concurrency, mode) cell, appending to records / outputs as each (T, clients) cell finishes.

    overhead: reads the coordinator's round-overhead histogram (cumulative); read around each
    mode's requests, it gives the records' round_overhead_ms_p50 / _p99.

    With --interleave N the modes take turns over N slices of the prompts, so slow drifts of a
    shared machine's speed hit every mode alike; a mode's wall time is the sum over its slices.
    The first plan.warm_requests requests of each mode run first and stay out of its record
    (they are in its per_request rows, the warm-up curve). before_mode: called before each
    service mode's cell (a learning drafter gets a fresh draft service there).

    Each service cell is its own tenant (a cache salt unique to the run and the cell): a drafter
    that learns across requests learns from the cell's own requests, as one caller's would, and
    never answers one mode from another's outputs, also against a running cluster (--address)
    that the bench cannot restart.
    """
    run_salt = secrets.token_hex(8)
    for temperature in plan.temperatures:
        for concurrency in plan.concurrency:
            cell_modes = [
                m for m in modes if not m.hf_baseline or concurrency == 1
            ]  # the HF baseline serves one sequence at a time
            slices = interleave_slices(len(items) - plan.warm_requests, concurrency, args.interleave)
            slices = [range(r.start + plan.warm_requests, r.stop + plan.warm_requests) for r in slices]
            if plan.warm_requests:
                slices.insert(0, range(plan.warm_requests))
            results: dict[str, list[RequestResult]] = {m.name: [] for m in cell_modes}
            warm: dict[str, list[RequestResult]] = {m.name: [] for m in cell_modes}
            walls = dict.fromkeys(results, 0.0)
            overheads: dict[str, Buckets] = {m.name: {} for m in cell_modes}
            for part, rows in enumerate(slices):
                for m in cell_modes:
                    if part == 0 and before_mode is not None and not m.hf_baseline:
                        before_mode(m)
                    chunk = [items[i] for i in rows]
                    where = f" {part + 1}/{len(slices)}" if len(slices) > 1 else ""
                    desc = f"T={temperature:g} c={concurrency} {m.name}{f' [{services}]' if services else ''}{where}"
                    with progress(len(chunk), desc, quiet) as bar:
                        if m.hf_baseline:
                            assert hf_baseline is not None
                            hf_baseline.configure(m)
                            start = time.perf_counter()
                            got = []
                            for i, (p, ids) in zip(rows, chunk):
                                got.append(
                                    hf_baseline.run(
                                        p.id,
                                        ids,
                                        m,
                                        temperature=temperature,
                                        seed=args.seed + i,
                                        max_new_tokens=plan.max_new_tokens,
                                        stop_at_eos=args.stop_at_eos,
                                    )
                                )
                                bar.update(1)
                            wall = time.perf_counter() - start
                        else:
                            before = overhead() if overhead is not None else {}
                            got, wall = run_service_cell(
                                address,
                                m,
                                chunk,
                                temperature=temperature,
                                concurrency=concurrency,
                                max_new_tokens=plan.max_new_tokens,
                                seed=args.seed + rows.start,
                                ignore_eos=not args.stop_at_eos,
                                timeout=args.timeout,
                                bar=bar,
                                metadata=metadata,
                                cache_salt=f"specd-bench-{run_salt}-T{temperature:g}-c{concurrency}-{m.name}",
                            )
                            if overhead is not None:
                                overheads[m.name] = add(overheads[m.name], difference(overhead(), before))
                        bar.set_postfix_str(
                            f"{sum(len(r.token_ids) for r in got if r.error is None) / wall:.1f} tok/s"
                            if wall > 0
                            else ""
                        )
                    if part == 0 and plan.warm_requests:
                        warm[m.name] += got  # the warm-up: in the curve, not in the record
                        continue
                    results[m.name] += got
                    walls[m.name] += wall
            for m in cell_modes:
                rec = summarize(
                    m,
                    temperature,
                    concurrency,
                    results[m.name],
                    walls[m.name],
                    max_new_tokens=plan.max_new_tokens,
                    cost=cost.get("hf" if m.hf_baseline else "service"),
                )
                rec["services"] = services
                rec["interleave_slices"] = len(slices) - (1 if plan.warm_requests else 0)
                rec["warm_requests"] = plan.warm_requests
                rec["per_request"] = per_request(warm[m.name] + results[m.name])
                if overheads[m.name]:
                    rec["round_overhead_ms_p50"] = quantile_ms(overheads[m.name], 0.50)
                    rec["round_overhead_ms_p99"] = quantile_ms(overheads[m.name], 0.99)
                outputs[(services, m.name, temperature, concurrency)] = {
                    r.prompt_id: r.token_ids for r in results[m.name] if r.error is None
                }
                if args.save_outputs:
                    rec["outputs"] = {r.prompt_id: r.token_ids for r in results[m.name]}
                records.append(rec)
