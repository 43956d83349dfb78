"""Drafters that learn across requests (suffix, suffix+MODEL): each mode from a fresh draft, the warm-up curve.

A suffix drafter's learned index remembers every finished request of a tenant, so two
modes run over the same prompts one after the other would let the second
answer from the first's outputs (at T = 0 they are the same text). The bench
therefore restarts the draft service before each speculative mode (a fresh,
empty index), waits until the coordinator drafts with it again, and runs the
mode's requests in sequence (one client), so that the index learns request by
request as it would in service. `--warm-requests N` keeps a mode's first N
requests out of its record (the record is the steady state "after warm-up");
every request is in the warm-up curve: speed-up over target-only by request
index, in groups.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.client import CoordinatorClient
from specd.tools.bench.results import RequestResult

# A prompt outside every shipped set that repeats itself: its rounds draft from the session's own
# tokens, which shows the coordinator reaches the draft again (its output joins the fresh index: a
# few tokens, unrelated to the measured prompts).
PROBE_TEXT = "red green blue red green blue red green blue red green blue red green"
PROBE_TIMEOUT_S = 60.0
CURVE_GROUPS = 6


def wait_until_drafting(address: str, probe_ids: list[int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Send short speculative requests until one gets draft tokens (the draft is reached); False on timeout."""
    deadline = time.monotonic() + timeout_s
    with CoordinatorClient(address, timeout=timeout_s) as client:
        while time.monotonic() < deadline:
            r = client.generate(
                probe_ids, max_new_tokens=6, temperature=0.0, ignore_eos=True, speculation="fixed", draft_length=2
            )
            if r.stats.draft_tokens > 0:
                return True
            time.sleep(0.5)
    return False


def per_request(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """What the warm-up curve needs of each request, in the order they ran."""
    out = []
    for r in results:
        stats = r.stats or {}
        out.append(
            {
                "prompt_id": r.prompt_id,
                "tokens": len(r.token_ids) if r.error is None else 0,
                "seconds": r.end - r.start,
                "draft_tokens": stats.get("draft_tokens", 0),
                "accepted_tokens": stats.get("accepted_tokens", 0),
                "error": r.error,
            }
        )
    return out


def warmup_curve(
    rows: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]], groups: int = CURVE_GROUPS
) -> list[dict[str, Any]]:
    """Speed-up over target-only and acceptance by request index, in `groups` consecutive groups.

    rows / baseline: per_request entries of a mode and of target-only over the same prompts, in order.
    A group's speed-up is its tokens per second of request time against target-only's for the same prompts.
    """
    base = {b["prompt_id"]: b for b in baseline}
    n = len(rows)
    groups = max(1, min(groups, n))
    out = []
    for g in range(groups):
        part = rows[round(g * n / groups) : round((g + 1) * n / groups)]
        ok = [r for r in part if not r["error"] and r["prompt_id"] in base and not base[r["prompt_id"]]["error"]]
        tokens, seconds = sum(r["tokens"] for r in ok), sum(r["seconds"] for r in ok)
        b_tokens = sum(base[r["prompt_id"]]["tokens"] for r in ok)
        b_seconds = sum(base[r["prompt_id"]]["seconds"] for r in ok)
        drafted = sum(r["draft_tokens"] for r in ok)
        first = round(g * n / groups) + 1
        out.append(
            {
                "requests": f"{first}-{first + len(part) - 1}",
                "speedup": (tokens / seconds) / (b_tokens / b_seconds) if seconds and b_seconds and b_tokens else None,
                "acceptance_rate": sum(r["accepted_tokens"] for r in ok) / drafted if drafted else None,
            }
        )
    return out
