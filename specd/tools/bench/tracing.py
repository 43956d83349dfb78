"""Tracing's cost: tokens/s with every request traced against none, on the same services."""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.client import CoordinatorClient
from specd.tools.bench.console import progress
from specd.tools.bench.modes import Mode
from specd.tools.bench.plan import BenchError, Plan
from specd.tools.bench.prompts import BenchPrompt
from specd.tools.bench.services import run_service_request


def untraced_metadata() -> tuple[tuple[str, str], ...]:
    """A W3C traceparent whose sampled flag is off: services with tracing on record nothing for the call."""
    return (("traceparent", f"00-{secrets.randbits(128) | 1:032x}-{secrets.randbits(64) | 1:016x}-00"),)


def measure_tracing_overhead(
    address: str,
    mode: Mode,
    items: Sequence[tuple[BenchPrompt, list[int]]],
    *,
    repeats: int,
    max_new_tokens: int,
    seed: int,
    ignore_eos: bool,
    timeout: float,
    spans: Callable[[], int],
    bar: Any,
) -> dict[str, Any]:
    """Tokens/s of `mode` with every request traced vs none, interleaved request by request.

    The services run with tracing on at 100% sampling, exporting to a real
    OTLP receiver. "off" requests carry a not-sampled traceparent, so they
    take the services' untraced path (no spans, no context in stream
    messages); "on" requests are traced and exported. Alternating the two
    per prompt (and the order per repeat) cancels the machine's drift.
    """
    wall = {"off": 0.0, "on": 0.0}
    tokens = {"off": 0, "on": 0}
    errors = 0
    options = dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos, **mode.request)
    with CoordinatorClient(address, timeout=timeout) as client:
        for rep in range(repeats):
            for i, (p, ids) in enumerate(items):
                order = ("off", "on") if (rep + i) % 2 == 0 else ("on", "off")
                for variant in order:
                    meta = untraced_metadata() if variant == "off" else ()
                    r = run_service_request(client, p.id, ids, dict(options, seed=seed + i), meta)
                    errors += r.error is not None
                    wall[variant] += r.end - r.start
                    tokens[variant] += len(r.token_ids)
                    bar.update(1)
    tps = {v: tokens[v] / wall[v] if wall[v] > 0 else None for v in wall}
    ratio = tps["on"] / tps["off"] if tps["on"] and tps["off"] else None
    return {
        "mode": mode.name,
        "repeats": repeats,
        "requests_per_variant": repeats * len(items),
        "errors": errors,
        "tokens_per_s_off": tps["off"],
        "tokens_per_s_on": tps["on"],
        "on_over_off": ratio,
        "overhead_pct": (1.0 - ratio) * 100 if ratio else None,
        "sample_ratio": 1.0,
        "spans_received": spans(),  # so far; the run updates it once the services have flushed
    }


def tracing_cell(
    args: argparse.Namespace,
    plan: Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    receiver: Any,
    quiet: bool,
) -> dict[str, Any]:
    service_modes = [m for m in modes if not m.hf_baseline]
    if args.tracing_mode:
        chosen = next((m for m in service_modes if m.name == args.tracing_mode), None)
        if chosen is None:
            raise BenchError(
                f"--tracing-mode {args.tracing_mode!r} is not one of this run's modes "
                f"({', '.join(m.name for m in service_modes)})"
            )
    else:
        chosen = next((m for m in service_modes if not m.baseline), service_modes[0])
    repeats = max(1, args.tracing_repeats)
    with progress(2 * repeats * len(items), f"tracing off/on {chosen.name}", quiet) as bar:
        return measure_tracing_overhead(
            address,
            chosen,
            items,
            repeats=repeats,
            max_new_tokens=plan.max_new_tokens,
            seed=args.seed,
            ignore_eos=not args.stop_at_eos,
            timeout=args.timeout,
            spans=lambda: receiver.span_count,
            bar=bar,
        )
