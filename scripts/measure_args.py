"""Option values the measurement scripts share (scripts/README.md): comma-separated lists.

Imported by the scripts beside it (`python scripts/NAME.py` puts this folder first on sys.path).
"""

from __future__ import annotations


def ints(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4], in the order given (empty items are skipped)."""
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    """'0,0.7' -> [0.0, 0.7], in the order given (empty items are skipped)."""
    return [float(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    """'self,demo' -> ['self', 'demo'], in the order given (empty items are skipped)."""
    return [x for x in text.split(",") if x.strip()]
