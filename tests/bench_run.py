"""How the service tests run `specd bench`: in-process, its report read back (fixture `run_bench`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from specd.tools.bench.main import run
from specd.tools.cli import build_parser
from tests.forkserver import shared_fork_server


class RunBench(Protocol):
    def __call__(self, *args: str) -> tuple[dict[str, Any], Path]: ...


def bench_runner(folder: Path) -> RunBench:
    """`specd bench ARGS --json FOLDER/bench.json --no-progress --strict`; exit code 0 asserted.

    --strict makes any failed request fail the run. The services it starts are forked from this
    test process's fork server (tests/forkserver.py), as the tests' clusters are: what the bench
    does with them is the same, without an interpreter's imports for each. Returns (the JSON
    report, its path); the Markdown and PNG reports lie beside it.
    """

    def run_bench(*args: str) -> tuple[dict[str, Any], Path]:
        out = folder / "bench.json"
        parsed = build_parser().parse_args(["bench", *args, "--json", str(out), "--no-progress", "--strict"])
        assert run(parsed, spawn=shared_fork_server().spawn) == 0
        return json.loads(out.read_text()), out

    return run_bench
