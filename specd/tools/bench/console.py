"""What the bench prints while it runs: progress bars and one-line notes, on stderr."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def progress(total: int, desc: str, disable: bool) -> Any:
    return tqdm(total=total, desc=desc, unit="req", disable=disable, file=sys.stderr, dynamic_ncols=True)


def say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)
