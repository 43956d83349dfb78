#!/usr/bin/env python
"""Where a speculation-cache round's milliseconds go, event by event, across the three processes.

While the target verifies round r, the draft drafts round r + 1 for the likeliest
verdicts of r (a branch call, launched once round r - 1's verdict reached the
coordinator), and the coordinator stages those branches at the target, which runs
the one its verdict on r names without waiting for the coordinator. That saves a
round trip only when the stage is there first. One cycle:

    verdict r - 1 (target) -> branch call out (coordinator) -> draft batch start
    -> draft batch end -> branches read (coordinator) -> stage read (target)

against verdict r: the stage is in time when it is read before it (slack > 0; a
later stage still runs the candidate at once, and the round record calls it
staged, but the target waited for it). This runs the setting of
scripts/round_overhead.py (one stream, spec-cache) with a timestamp at each of
those points in each process (a sitecustomize on the services' PYTHONPATH and
patches of the coordinator in this process: a measuring probe; nothing of specd
changes), matches the events cycle by cycle by the round's committed length, and
prints each segment's median. Clock: perf_counter_ns, one monotonic clock for
every process of the host.

    .venv/bin/python scripts/round_timeline.py --model sim:h100-8b --draft-length 2
    .venv/bin/python scripts/round_timeline.py --model sim:h100-tp2-70b --draft-length 3 --json FILE

The probes add a few microseconds per event. With an emulated model every figure is emulated.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import round_overhead

from specd.core.rounds import pipeline
from specd.core.rounds.steps import DEFAULT_BRANCH_BUDGET
from specd.serving.server import run_event_loop

ENV = "SPECD_ROUND_TIMELINE"  # the event files' prefix; set, the services' hooks write to PREFIX.PID

# Installed in each service process (its PYTHONPATH starts with this file's folder while ENV is set).
# Every event carries the committed length of the round it belongs to: the round being verified
# while its branches are drafted (a branch call's prefix less its pending tokens; a stage's and
# that round's verify's committed_length).
_SERVICE_HOOKS = """
import os, time

def _install():
    prefix = os.environ.get("SPECD_ROUND_TIMELINE")
    if not prefix:
        return
    out = open(f"{prefix}.{os.getpid()}", "a", buffering=1)

    def event(name, key, at=None):
        out.write(f"{time.perf_counter_ns() if at is None else at} {name} {key}\\n")

    try:
        import draft_service.servicer as ds
        from specd.core.rounds.steps import BranchRequest
    except ImportError:
        return
    run = ds.DraftServicer.run_step_batch

    def run_step_batch(self, work):
        keys = [w.committed_length - w.pending for w in work if isinstance(w, BranchRequest)]
        for key in keys:
            event("draft_start", key)
        try:
            return run(self, work)
        finally:
            for key in keys:
                event("draft_end", key)

    ds.DraftServicer.run_step_batch = run_step_batch
    import target_service.staging as st
    hold, after = st.StagedVerifies.hold, st.StagedVerifies.after_batch

    def hold_(self, items):
        for item in items:
            if item.request.WhichOneof("op") == "stage":
                event("stage_read", item.request.committed_length, item.arrived_ns)
        return hold(self, items)

    def after_(self, items, responses):
        for item in items:
            if item.request.WhichOneof("op") == "verify":
                event("verdict", item.request.committed_length)
        return after(self, items, responses)

    st.StagedVerifies.hold, st.StagedVerifies.after_batch = hold_, after_


_install()
"""

# A cycle, keyed by the committed length c of round r (the one verified while round r + 1's
# branches are drafted); `prev` is the verdict of round r - 1, which launched the call.
SEGMENTS = [
    ("verdict r-1 -> branch call out (target, coordinator)", "prev", "call"),
    ("branch call out -> draft batch start", "call", "draft_start"),
    ("draft batch (passes + host work)", "draft_start", "draft_end"),
    ("draft batch end -> coordinator reads the branches", "draft_end", "reply"),
    ("coordinator -> target reads the stage", "reply", "stage_read"),
]
SLACK = "slack: stage read (or branches read, if none) before verdict r"
STAGED = "staged"
CYCLE = "cycle: verdict r-1 -> verdict r"


def install_coordinator_hooks(event: Any) -> None:
    """Timestamp the speculation cache's branch calls in this process (the coordinator)."""
    cache = pipeline.SpecCache
    launch, branches = cache.launch, cache._branches

    def launch_(self: Any, rnd: Any) -> int:
        event("call", len(rnd.committed))
        return launch(self, rnd)

    async def branches_(self: Any, rnd: Any, rates: Any, budget: int) -> Any:
        draft_branches = rnd.draft_branches

        async def timed(*a: Any, **k: Any) -> Any:
            try:
                return await draft_branches(*a, **k)
            finally:
                event("reply", len(rnd.committed))

        return await branches(self, dataclasses.replace(rnd, draft_branches=timed), rates, budget)

    setattr(cache, "launch", launch_)  # noqa: B010 - a probe replaces the methods for this process
    setattr(cache, "_branches", branches_)  # noqa: B010


def cycles(events: list[tuple[int, str, int]]) -> list[dict[str, float]]:
    """Each branch call's cycle (segments in ms, the stage's slack, the verdict-to-verdict time),
    for the calls whose events came in order, after the verdict of the round before and before the
    next call (the stage: within a cycle after the verdict). A call answered after its round's
    verdict sends no stage: its slack is then how long before the verdict the branches were read
    (negative), and "staged" is 0.

    Requests run one after another and start at the same prompt length, so a round's key recurs:
    each event is the first of its kind and key after the call (the verdict before it: the last)."""
    times: dict[tuple[str, int], list[int]] = {}
    for t, name, key in sorted(events):
        times.setdefault((name, key), []).append(t)
    calls = sorted((t, key) for t, name, key in events if name == "call")

    def after(name: str, key: int, t: int, bound: int) -> int | None:
        ts = times.get((name, key), [])
        i = bisect.bisect_left(ts, t)
        return ts[i] if i < len(ts) and ts[i] < bound else None

    def before(name: str, key: int, t: int) -> int | None:
        ts = times.get((name, key), [])
        i = bisect.bisect_right(ts, t)
        return ts[i - 1] if i else None

    out = []
    for (t_prev_call, prev_key), (t_call, key), (t_next, _) in zip(calls, calls[1:], calls[2:]):
        found = {"call": t_call, "prev": before("verdict", prev_key, t_call)}
        for name in ("draft_start", "draft_end", "reply", "verdict"):
            found[name] = after(name, key, t_call, t_next)
        at = {name: t for name, t in found.items() if t is not None}
        if len(at) < len(found) or at["prev"] < t_prev_call:
            continue  # an event missing, or round r - 1 not verified between the calls (a new request)
        chain = [at[n] for n in ("prev", "call", "draft_start", "draft_end", "reply")]
        if chain != sorted(chain):
            continue
        stage = after("stage_read", key, at["reply"], 2 * at["verdict"] - at["prev"])  # within a cycle of it
        row = {label: (at[b] - at[a]) / 1e6 for label, a, b in SEGMENTS if b != "stage_read"}
        if stage is not None:
            row[SEGMENTS[-1][0]] = (stage - at["reply"]) / 1e6
        row[SLACK] = (at["verdict"] - (stage if stage is not None else at["reply"])) / 1e6
        row[STAGED] = float(stage is not None)
        row[CYCLE] = (at["verdict"] - at["prev"]) / 1e6
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sim:h100-8b", help="both services' model (sim:PROFILE or a folder)")
    parser.add_argument("--draft-length", type=int, default=2, help="the speculation cache's K")
    parser.add_argument("--rounds", type=int, default=300, help="about this many rounds")
    parser.add_argument("--request-tokens", type=int, default=64, help="each request's length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--branch-budget", type=int, default=DEFAULT_BRANCH_BUDGET)
    parser.add_argument("--json", default="", help="also write the medians here")
    parser.add_argument("--events", default="", help="keep the raw event files (TIME EVENT ROUND per line) here")
    args = parser.parse_args()
    folder = Path(args.events) if args.events else Path(tempfile.mkdtemp(prefix="specd-timeline-"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("events.*"):
        old.unlink()
    (folder / "sitecustomize.py").write_text(_SERVICE_HOOKS)
    prefix = str(folder / "events")
    os.environ[ENV] = prefix
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    overhead = round_overhead.parse_arguments(
        [
            *("--model", args.model, "--streams", "1", "--rounds", str(args.rounds)),
            *("--draft-length", str(args.draft_length), "--request-tokens", str(args.request_tokens)),
            *("--temperature", str(args.temperature), "--pipeline", "spec-cache"),
            *("--branch-budget", str(args.branch_budget)),
        ]
    )
    sys.setswitchinterval(overhead.gil_switch_ms / 1e3)
    with open(f"{prefix}.{os.getpid()}", "a", buffering=1) as mine:
        install_coordinator_hooks(lambda name, key: mine.write(f"{time.perf_counter_ns()} {name} {key}\n"))
        run_event_loop(round_overhead.measure(overhead), overhead.event_loop)
    events: list[tuple[int, str, int]] = []
    for path in folder.glob("events.*"):
        for line in path.read_text().splitlines():
            t, name, key = line.split()
            events.append((int(t), name, int(key)))
    rows = cycles(events)
    if not rows:
        raise SystemExit("no complete spec-cache cycle was recorded")
    names = [label for label, _, _ in SEGMENTS] + [SLACK, CYCLE]
    medians = {n: statistics.median(r[n] for r in rows if n in r) for n in names if any(n in r for r in rows)}
    staged = sum(r[STAGED] > 0 for r in rows)
    in_time = sum(r[STAGED] > 0 and r[SLACK] > 0 for r in rows)
    print(
        f"\n{args.model} spec-cache K={args.draft_length} T={args.temperature}: {len(rows)} cycles, "
        f"{staged} sent a stage, {in_time} ({in_time / len(rows):.0%}) read before the verdict"
    )
    for name, ms in medians.items():
        print(f"  {name:62s} {ms:8.2f} ms (p50)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"arguments": vars(args), "cycles": len(rows), "staged": staged, "in_time": in_time, "p50_ms": medians},
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
