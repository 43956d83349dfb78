"""Print the uv arguments that make `uv pip install` read the packages pip would read.

    python scripts/uv_sources.py --python .venv/bin/python          uv's arguments, one a line
    python scripts/uv_sources.py --python .venv/bin/python --cert   pip's CA bundle, if it has one

scripts/setup.sh installs with uv (a few times faster than pip: 34 s against about 100 s for
specd's dependencies on a 2-core machine with empty caches) but must install what pip would:
the same indexes, find-links folders and constraints. uv reads none of pip's configuration, so
this asks pip for its own (`pip config list`: the environment's PIP_* variables and every
pip.conf) and prints one argument per line for uv. A key set in the environment wins over the
files, as in pip. `--index-strategy unsafe-best-match` gives pip's rule (the best version over
all indexes; uv's default stops at the first index that has the package), and
`--compile-bytecode` pip's habit of writing bytecode at install time, which every process the
tests start would otherwise pay for on import when PYTHONDONTWRITEBYTECODE is set. uv trusts
its own CA roots; pip's `cert` goes to uv as SSL_CERT_FILE (`--cert` prints it).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

# pip's option → uv's; a pip value may hold several, space-separated (extra-index-url, find-links).
_LIST_OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_config(python: str) -> dict[str, str]:
    """pip's configuration as `pip config list` prints it: key → value, the environment last."""
    done = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True, timeout=60
    )
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in done.stdout.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        scope, _, key = name.rpartition(".")
        value = " ".join(shlex.split(raw))
        (env if scope == ":env:" else files)[key] = value
    return {**files, **env}


def uv_arguments(config: dict[str, str]) -> list[str]:
    """uv pip install arguments for pip's configuration."""
    args: list[str] = []
    for key, option in _LIST_OPTIONS.items():
        for value in config.get(key, "").split():
            args += [option, value]
    if config.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        args.append("--no-index")
    return args + ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose pip configuration to read")
    parser.add_argument("--cert", action="store_true", help="print pip's CA bundle (empty when it has none)")
    args = parser.parse_args()
    config = pip_config(args.python)
    print(config.get("cert", "") if args.cert else "\n".join(uv_arguments(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
