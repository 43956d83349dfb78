"""How the service tests run `specd bench`: in-process, its report read back (fixture `run_bench`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from specd.tools.cli import main


class RunBench(Protocol):
    def __call__(self, *args: str) -> tuple[dict[str, Any], Path]: ...


def bench_runner(folder: Path) -> RunBench:
    """`specd bench ARGS --json FOLDER/bench.json --no-progress --strict`; exit code 0 asserted.

    --strict makes any failed request fail the run. Returns (the JSON report, its
    path); the Markdown and PNG reports lie beside it.
    """

    def run(*args: str) -> tuple[dict[str, Any], Path]:
        out = folder / "bench.json"
        rc = main(["bench", *args, "--json", str(out), "--no-progress", "--strict"])
        assert rc == 0
        return json.loads(out.read_text()), out

    return run
