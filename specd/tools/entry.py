"""The `specd` command's entry point: settings gRPC reads when it loads, then the CLI.

gRPC reads its environment once, when it is imported, so the defaults go
into the environment before anything imports it (specd.tools.cli does). An
explicit setting in the environment wins.

    python -m specd.tools.entry serve target ...   # what the launcher runs
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType

# gRPC's C core logs at INFO to stderr (e.g. each failed TLS handshake); specd reports what it means
# in its own words. Read when grpc is imported. ERROR keeps its errors.
_GRPC_DEFAULTS = {"GRPC_VERBOSITY": "ERROR"}


def load_cli() -> ModuleType:
    """specd.tools.cli, imported after the environment defaults are set (this import loads grpc)."""
    os.environ.update({k: v for k, v in _GRPC_DEFAULTS.items() if k not in os.environ})
    from specd.tools import cli  # noqa: PLC0415 - after the environment is set

    return cli


def main(argv: Sequence[str] | None = None) -> int:
    return int(load_cli().main(argv))


if __name__ == "__main__":
    sys.exit(main())
