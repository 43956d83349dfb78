"""The PNG plot of a run: speed-up per mode, acceptance per draft position, tokens/s against clients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specd.tools.bench.modes import BASELINE
from specd.tools.bench.records import concurrency_table, row_name


def write_plot(records: Sequence[Mapping[str, Any]], path: Path, label: str = "") -> None:
    """Speed-up per mode (one bar per cell), acceptance per draft position, and, when the run
    has several concurrency levels, tokens/s against concurrent clients."""
    # matplotlib is the optional `bench` extra (pyproject): imported here, so the rest of the bench
    # (and the CLI, which imports this package to build its parser) works without it.
    import matplotlib  # noqa: PLC0415 - the optional `bench` extra

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use

    levels = sorted({r["concurrency"] for r in records})
    panels = 3 if len(levels) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    ax1, ax2 = axes[0], axes[1]
    if panels == 3:
        t0 = min(r["temperature"] for r in records)
        cols, rows = concurrency_table(records, t0)
        for name, by_c in rows:
            xs = [c for c in cols if c in by_c]
            axes[2].plot(xs, [by_c[c] for c in xs], marker="o", label=name)
        axes[2].set_xscale("log", base=2)
        axes[2].set_xticks(cols)
        axes[2].set_xticklabels([str(c) for c in cols])
        axes[2].set_xlabel("concurrent clients")
        axes[2].set_ylabel("aggregate tokens/s")
        axes[2].set_title(f"Throughput against concurrency (T={t0:g})")
        axes[2].legend(fontsize=8)
    modes = [m for m in dict.fromkeys(row_name(r) for r in records) if m != BASELINE]
    cells = list(dict.fromkeys((r["temperature"], r["concurrency"]) for r in records))
    width = 0.8 / max(1, len(cells))
    for j, (t, c) in enumerate(cells):
        values = []
        for m in modes:
            hit = next(
                (r for r in records if row_name(r) == m and r["temperature"] == t and r["concurrency"] == c), None
            )
            values.append(hit["speedup"] if hit and hit["speedup"] is not None else math.nan)
        positions = [i + (j - (len(cells) - 1) / 2) * width for i in range(len(modes))]
        ax1.bar(positions, values, width, label=f"T={t:g}, {c} client{'s' if c > 1 else ''}")
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(modes)))
    ax1.set_xticklabels(modes, rotation=30, ha="right")
    ax1.set_ylabel(f"speed-up over {BASELINE} (tokens/s ratio)")
    ax1.set_title("Speed-up per mode")
    ax1.legend(fontsize=8)
    low_c = min((c for _, c in cells), default=1)
    for r in records:
        if r["acceptance_per_position"] and r["concurrency"] == low_c:
            ys = r["acceptance_per_position"]
            ax2.plot(
                range(1, len(ys) + 1),
                ys,
                marker="o",
                linestyle="-" if r["temperature"] == 0 else "--",
                label=f"{row_name(r)} T={r['temperature']:g}",
            )
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance (accepted / rounds that drafted)")
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"Acceptance per draft position ({low_c} client{'s' if low_c > 1 else ''})")
    if ax2.lines:
        ax2.legend(fontsize=8)
        ax2.xaxis.get_major_locator().set_params(integer=True)
    if label:  # e.g. "emulated: h100-tp2-70b": every plot made on an emulator says so
        fig.suptitle(label, fontsize=11, color="darkred")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
