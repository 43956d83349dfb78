"""`specd bench`: the run, from starting the services to the written JSON, markdown and PNG."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from specd.core.errors import InvalidArgument
from specd.core.model import catalog
from specd.core.model.catalog import MODEL_FREE_DRAFTS
from specd.core.model.sim import SimProfile
from specd.serving.config import default_cache_dir
from specd.tools.bench.cells import run_cells, warm_up
from specd.tools.bench.compare import finish_records
from specd.tools.bench.console import say
from specd.tools.bench.hf_baseline import HFBaseline
from specd.tools.bench.learning import PROBE_TEXT, wait_until_drafting
from specd.tools.bench.modes import BASELINE, DEFAULT_MODES, RUNNER_HF, Mode, largest_k
from specd.tools.bench.output import build_meta, write_report
from specd.tools.bench.overhead import Buckets, metrics_address, read_overhead
from specd.tools.bench.plan import (
    BATCHING_SETUPS,
    BenchError,
    Plan,
    ServiceSetup,
    learns_across_requests,
    make_plan,
    output_paths,
)
from specd.tools.bench.prepare import prepare_run
from specd.tools.bench.prompts import BenchPrompt
from specd.tools.bench.records import batching_gains
from specd.tools.bench.sim import apply_sim, print_profiles, sim_cost, sim_meta
from specd.tools.bench.tracing import tracing_cell, untraced_metadata
from specd.tools.localcluster import LocalCluster, Spawn, peak_rss_of
from specd.tools.otlp_receiver import OtlpReceiver


class _Phases:
    """Seconds per phase of the run (meta.phases_s), each from the end of the previous one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._mark
        self._mark = now


@dataclass
class _State:
    """What the run has collected so far: an interrupted run still reports it."""

    records: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[tuple[str, str, float, int], dict[str, list[int]]] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    peak: dict[str, Any] = field(default_factory=dict)
    items: list[tuple[BenchPrompt, list[int]]] = field(default_factory=list)  # prompts as token IDs
    hf_baseline: HFBaseline | None = None
    tracing: dict[str, Any] | None = None
    interrupted: bool = False
    address: str = ""  # the last services' coordinator
    started: bool = False  # whether the bench started those services
    metrics: str | None = None  # that coordinator's metrics endpoint (round overhead), when the bench started it


@dataclass(frozen=True)
class _Pair:
    """The models of the run: folders (draft None: a model-free drafter), cache and tokenizer."""

    target_dir: Path
    draft_dir: Path | None
    cache: Path
    tokenizer: Any
    draft_spec: str  # what the draft service's --model gets (a folder, ngram, suffix, suffix+FOLDER)
    sim: SimProfile | None = None  # --sim: both services run this emulated pair


def run(args: argparse.Namespace, *, spawn: Spawn | None = None) -> int:
    """`specd bench`: returns the exit status (0; 1 with --strict when a check failed; 2 bad set-up; 130 interrupted).

    spawn: how the services it starts are started (LocalCluster's; default a fresh interpreter each).
    """
    t_run = time.perf_counter()
    if getattr(args, "list_sim_profiles", False):
        return print_profiles()
    sim = None
    if getattr(args, "sim", ""):
        try:
            sim = apply_sim(args, DEFAULT_MODES)
        except InvalidArgument as exc:
            print(f"specd bench: --sim: {exc}", file=sys.stderr)
            return 2
    try:
        plan = make_plan(args)
    except (ValueError, OSError) as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 2
    restore_sigterm = _sigterm_as_interrupt()
    try:
        return _run(args, plan, t_run, sim, spawn)
    finally:
        restore_sigterm()


def _sigterm_as_interrupt() -> Callable[[], None]:
    """SIGTERM raises KeyboardInterrupt (so the services get stopped and a partial report written); returns undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    return undo


def _run(args: argparse.Namespace, plan: Plan, t_run: float, sim: SimProfile | None, spawn: Spawn | None) -> int:
    json_path, md_path, png_path = output_paths(args)
    phase = _Phases()
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    target_dir = catalog.target_folder(args.target, cache)
    hybrid = catalog.hybrid_model(args.draft)
    draft_dir = (
        None
        if args.draft in MODEL_FREE_DRAFTS
        else catalog.draft_folder(hybrid or args.draft, args.target, cache)  # suffix+MODEL: MODEL's folder, for c
    )
    draft_spec = (
        args.draft if draft_dir is None else f"{catalog.HYBRID_PREFIX}{draft_dir}" if hybrid else str(draft_dir)
    )
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    pair = _Pair(target_dir, draft_dir, cache, tokenizer, draft_spec, sim)
    setups = BATCHING_SETUPS[args.batching]
    if args.address and len(setups) > 1:
        print("specd bench: --batching both starts its own services; drop --address", file=sys.stderr)
        return 2
    if args.tracing_overhead and args.address:
        print("specd bench: --tracing-overhead starts its own services; drop --address", file=sys.stderr)
        return 2
    receiver = OtlpReceiver(keep=False) if args.tracing_overhead else None
    state = _State()
    try:
        status = _run_setups(args, plan, pair, setups, receiver, state, phase, spawn)
    finally:
        if receiver is not None:
            receiver.stop()  # after the services stopped: they flush their last spans on the way out
            if state.tracing is not None:
                state.tracing["spans_received"] = receiver.span_count
    if status is not None:
        return status
    bench_rss = peak_rss_of(os.getpid())
    state.peak["bench"] = bench_rss / 2**20 if bench_rss is not None else None
    phase("stop_services_s")
    return _report(args, plan, pair, state, phase, (json_path, md_path, png_path), time.perf_counter() - t_run)


def _run_setups(
    args: argparse.Namespace,
    plan: Plan,
    pair: _Pair,
    setups: Sequence[ServiceSetup],
    receiver: OtlpReceiver | None,
    state: _State,
    phase: _Phases,
    spawn: Spawn | None,
) -> int | None:
    """Every service set-up in turn: start (or reach) the services, measure, stop. An exit status ends the run early."""
    tracing_args = ["--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1"] if receiver is not None else []
    for index, setup in enumerate(setups):
        cluster = None
        label = f" [{setup.label}]" if setup.label else ""
        if not args.address:
            say(
                f"starting target, draft and coordinator{label} ({pair.target_dir.name}, "
                f"{pair.draft_dir.name if pair.draft_dir else args.draft}) ...",
                args.no_progress,
            )
            cluster = _cluster(args, plan, pair, setup, tracing_args, spawn)
            try:
                cluster.start()
            except RuntimeError as exc:
                print(f"specd bench: {exc}\n{cluster.logs()}", file=sys.stderr)
                return 2
        state.address = cluster.address if cluster is not None else args.address
        state.started = cluster is not None
        state.metrics = metrics_address(cluster.coordinator.lines) if cluster and cluster.coordinator else None
        phase(f"start_services{setup.label and '_' + setup.label}_s")
        try:
            _measure(args, plan, pair, setup, index, receiver, state, phase, _fresh_draft(args, pair, cluster))
            if cluster is not None:
                rss = {k: (v / 2**20 if v is not None else None) for k, v in cluster.peak_rss_bytes().items()}
                state.peak.update({f"{k}{label}": v for k, v in rss.items()})
        except BenchError as exc:
            print(f"specd bench: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if not state.records:
                print("specd bench: interrupted before the first cell; nothing to report", file=sys.stderr)
                return 130
            state.interrupted = True
        except Exception:
            if cluster is not None:
                print(cluster.logs(), file=sys.stderr)
            raise
        finally:
            if cluster is not None:
                cluster.stop()
        if state.interrupted:
            break
    return None


def _cluster(
    args: argparse.Namespace,
    plan: Plan,
    pair: _Pair,
    setup: ServiceSetup,
    tracing_args: list[str],
    spawn: Spawn | None,
) -> LocalCluster:
    """The three services of one set-up, sized for the largest K the run drafts with."""
    k_max = largest_k(plan.modes, plan.draft_lengths)
    n_max = max([32, k_max, *(int(m.request.get("tree_budget", 0)) for m in plan.modes)])  # a tree's nodes are drafts
    extra = [*setup.model_service_args, *tracing_args]
    return LocalCluster(
        args.target if pair.sim else pair.target_dir,  # an emulated model is its spec, not a folder
        args.draft if pair.sim else pair.draft_spec,
        cache_dir=pair.cache,
        target_threads=args.target_threads,
        draft_threads=args.draft_threads,
        coordinator_threads=1,
        target_args=["--max-draft-tokens", str(n_max), *extra, *shlex.split(args.target_args)],
        draft_args=["--max-draft-tokens", str(n_max), *extra, *shlex.split(args.draft_args)],
        coordinator_args=[
            "--max-draft-length",
            str(max(16, k_max)),
            "--max-tree-budget",
            str(n_max),
            "--metrics-port",  # the round-overhead histogram the records' overhead figures come from
            "0",
            *tracing_args,
            *shlex.split(args.coordinator_args),
        ],
        ready_timeout_s=600.0,
        echo=args.verbose,
        spawn=spawn,
    )


def _fresh_draft(args: argparse.Namespace, pair: _Pair, cluster: LocalCluster | None) -> Callable[[Mode], None] | None:
    """For a drafter that learns across requests: restart the draft before each speculative mode (an empty
    index, so no mode answers from another's outputs) and wait until the coordinator drafts with it again."""
    if not learns_across_requests(args.draft):
        return None
    if cluster is None or cluster.draft is None:
        print(
            f"specd bench: --draft {args.draft} learns across requests, but with --address the bench cannot "
            "restart it: later modes see the outputs of earlier ones",
            file=sys.stderr,
        )
        return None
    draft = cluster.draft
    probe = [int(t) for t in pair.tokenizer(PROBE_TEXT)["input_ids"]]

    def before(mode: Mode) -> None:
        if mode.baseline:
            return  # target-only never reaches the draft
        draft.stop(grace_s=10.0)
        draft.restart(cluster.env)
        if not wait_until_drafting(cluster.address, probe):
            raise BenchError(f"the coordinator did not draft with the restarted draft service\n{cluster.logs()}")

    return before


def _measure(
    args: argparse.Namespace,
    plan: Plan,
    pair: _Pair,
    setup: ServiceSetup,
    index: int,
    receiver: OtlpReceiver | None,
    state: _State,
    phase: _Phases,
    before_mode: Callable[[Mode], None] | None = None,
) -> None:
    """On running services: prepare (first set-up only), warm up, run every cell (and the tracing cell)."""
    quiet = args.no_progress
    if not state.items:
        state.items, state.hf_baseline = prepare_run(
            args, plan, state.address, pair.tokenizer, pair.target_dir, pair.draft_dir, state.cost, quiet, phase
        )
        if pair.sim is not None:
            lengths = sorted(len(ids) for _, ids in state.items)
            verify_ks = sorted({m.draft_length for m in plan.modes if m.draft_length} | set(plan.draft_lengths))
            state.cost["service"] = sim_cost(pair.sim, lengths[len(lengths) // 2], verify_ks)
    hf_baseline = (
        state.hf_baseline if index == 0 else None
    )  # the HF baseline does not depend on the services: measured once
    modes = [m for m in plan.modes if not m.hf_baseline or hf_baseline is not None]
    # With tracing on, the ordinary cells opt out per request, so they cost what they cost without it.
    metadata = untraced_metadata if receiver is not None else (lambda: ())
    warm_up(args, plan, modes, state.items, state.address, hf_baseline, quiet, metadata)
    phase(f"warmup{setup.label and '_' + setup.label}_s")
    try:
        run_cells(
            args,
            plan,
            modes,
            state.items,
            state.address,
            hf_baseline,
            state.cost,
            state.records,
            state.outputs,
            quiet,
            setup.label,
            metadata,
            before_mode,
            overhead=_overhead_reader(state.metrics),
        )
        if receiver is not None and index == 0:
            state.tracing = tracing_cell(args, plan, modes, state.items, state.address, receiver, quiet)
    except KeyboardInterrupt:
        state.interrupted = True
        print(
            f"specd bench: interrupted; stopping the services and writing the {len(state.records)} records so far",
            file=sys.stderr,
            flush=True,
        )
    phase(f"cells{setup.label and '_' + setup.label}_s")


def _overhead_reader(address: str | None) -> Callable[[], Buckets] | None:
    """Reads the coordinator's round-overhead histogram (None: no metrics endpoint, e.g. --address)."""
    if address is None:
        return None
    return lambda: read_overhead(address)


def _report(
    args: argparse.Namespace,
    plan: Plan,
    pair: _Pair,
    state: _State,
    phase: _Phases,
    paths: tuple[Path, Path, Path],
    duration_s: float,
) -> int:
    """Speed-ups and the greedy check, the three files, and the exit status."""
    records = state.records
    correctness = finish_records(records, state.outputs)
    meta = build_meta(
        args,
        plan,
        pair.target_dir,
        pair.draft_dir,
        state.address,
        state.started,
        state.cost,
        state.peak,
        correctness,
        duration_s,
    )
    meta["phases_s"] = phase.seconds
    if pair.sim is not None:
        meta["emulated"] = sim_meta(pair.sim)
        meta["models"] = {"target": f"{args.target} (emulated)", "draft": f"{args.draft} (emulated)"}
    meta["interrupted"] = state.interrupted
    meta["batching_gains"] = batching_gains(records)
    meta["tracing_overhead"] = state.tracing
    markdown = write_report({"meta": meta, "records": records}, *paths)
    print(markdown)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if state.interrupted:
        return 130
    failed = correctness["identical"] is False or any(r["errors"] for r in records if r["runner"] != RUNNER_HF)
    if correctness["identical"] is False:
        print(f"specd bench: greedy output differs from {BASELINE}: {correctness['failures']}", file=sys.stderr)
    return 1 if args.strict and failed else 0
