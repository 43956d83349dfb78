"""Decoding modes: what the bench runs for each prompt of a cell (data, not code paths)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RUNNER_SERVICE = "service"  # through the Coordinator API of the services
RUNNER_HF = "hf"  # transformers' generate(), in this process (the HF baseline)

BASELINE = "target-only"

# ---- modes --------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One way to decode: what the bench runs for each prompt of a cell.

    runner "service": `request` are CoordinatorClient.generate_stream keyword
    options (speculation, draft_length, and whatever the API grows).
    runner "hf": `request` are assisted-generation settings set on the
    draft's generation_config (num_assistant_tokens, ...); {"assistant":
    False} runs the target alone.
    draft_length: K for the theoretical speed-up S(K); None when the mode
    picks K itself (then the measured mean draft length is used).
    """

    name: str
    runner: str
    request: Mapping[str, Any] = field(default_factory=dict)
    draft_length: int | None = None

    @property
    def baseline(self) -> bool:
        return self.name == BASELINE

    @property
    def hf_baseline(self) -> bool:
        return self.runner == RUNNER_HF


# Single modes of the services, by name: request options. Extension point: add a line per new option.
SERVICE_MODES: dict[str, dict[str, Any]] = {
    BASELINE: {"speculation": "off"},
    "auto": {"speculation": "auto"},  # adaptive K (the coordinator picks K per session); server's pipelining default
    "auto-off": {"speculation": "auto", "pipeline": False},  # auto's K, never a pipeline
    "auto-pipelined": {"speculation": "auto", "pipeline": True},
    "auto-speccache": {"speculation": "auto", "pipeline": "spec-cache"},
}

# Families of the services: NAME-K (or bare NAME: one mode per --draft-lengths K).
SERVICE_FAMILIES: dict[str, Callable[[int], dict[str, Any]]] = {
    "fixed": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": False},
    "pipelined": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": True},  # bonus-match pipelining
    "postverify": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": "post-verify"},  # PEARL's
    "speccache": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": "spec-cache"},  # SSD / Saguaro's
}

# Tree speculation (docs/trees.md): tree-N drafts trees of at most N nodes, min(N, the largest
# --draft-lengths K) levels deep (like for like with fixed-K: the same depth, wider), fixed, no pipelining;
# pipelined-tree-N[xD] the same trees pipelined by bonus-match (docs/trees.md, "Pipelined trees").
TREE = "tree"
PIPELINED_TREE = "pipelined-tree"


# tree-N, or tree-NxD: N nodes, D levels; pipelined-tree-N[xD] likewise
_TREE_NAME = re.compile(rf"({PIPELINED_TREE}|{TREE})(?:-(\d+)(?:x(\d+))?)?")


def tree_mode(budget: int, draft_lengths: Sequence[int], depth: int | None = None, pipelined: bool = False) -> Mode:
    """tree-N: min(N, the largest K) levels deep; tree-NxD: D levels (a shallow, wide tree where a
    draft pass costs more than a level is likely to return). pipelined: the next tree is grown during
    the verify (bonus-match)."""
    levels = depth if depth is not None else max(1, min(budget, max(draft_lengths, default=4)))
    request = {"speculation": "fixed", "draft_length": levels, "tree_budget": budget, "pipeline": pipelined}
    family = PIPELINED_TREE if pipelined else TREE
    name = f"{family}-{budget}" if depth is None else f"{family}-{budget}x{depth}"
    return Mode(name, RUNNER_SERVICE, request)  # draft_length None: S(K) is a chain's theory


# The HF baseline: transformers' assisted generation. hf-K: K assistant tokens, constant
# schedule, no confidence early stop (like for like with fixed-K).
HF_DEFAULT = "hf-default"  # transformers' own defaults for the assistant
HF_TARGET_ONLY = "hf-target-only"  # transformers' generate() on the target alone


HF_LOOKUP = "hf-lookup"  # transformers' prompt lookup decoding: the HF baseline of --draft ngram (hf-lookup-K)


def _hf_fixed(k: int) -> dict[str, Any]:
    return {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }


DEFAULT_MODES = "target-only,fixed,pipelined,auto,hf,hf-default"


def parse_modes(spec: str, draft_lengths: Sequence[int], custom: Sequence[str] = ()) -> list[Mode]:
    """Modes from a comma list (see --modes), then --custom-mode specs; target-only always first."""
    modes: list[Mode] = []
    for raw in [s.strip() for s in spec.split(",") if s.strip()]:
        modes.extend(_expand_mode(raw, draft_lengths))
    modes.extend(parse_custom_mode(c) for c in custom)
    if not any(m.baseline for m in modes):
        modes.insert(0, Mode(BASELINE, RUNNER_SERVICE, SERVICE_MODES[BASELINE]))
    modes.sort(key=lambda m: not m.baseline)  # stable: the baseline first, the rest as given
    names = [m.name for m in modes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"mode names must be unique (repeated: {', '.join(dupes)})")
    return modes


def largest_k(modes: Sequence[Mode], draft_lengths: Sequence[int]) -> int:
    """The largest K any mode of the run drafts with (or --draft-lengths names)."""
    return max([m.draft_length or 0 for m in modes] + list(draft_lengths))


def cap_adaptive_modes(modes: Sequence[Mode], draft_lengths: Sequence[int]) -> list[Mode]:
    """Let modes that choose K themselves (auto) choose up to the largest K the run gives a fixed mode.

    Like for like: "auto is within 5% of the best fixed K" only means something
    when auto may pick that K. A mode that names its own draft_length keeps it.
    """
    k_max = largest_k(modes, draft_lengths)
    out: list[Mode] = []
    for m in modes:
        if m.runner == RUNNER_SERVICE and m.request.get("speculation") == "auto" and "draft_length" not in m.request:
            m = Mode(m.name, m.runner, {**m.request, "draft_length": k_max}, m.draft_length)
        out.append(m)
    return out


def _expand_mode(raw: str, draft_lengths: Sequence[int]) -> list[Mode]:
    if raw in SERVICE_MODES:
        return [Mode(raw, RUNNER_SERVICE, SERVICE_MODES[raw])]
    if raw == HF_DEFAULT:
        return [Mode(raw, RUNNER_HF, {})]
    if raw == HF_TARGET_ONLY:
        return [Mode(raw, RUNNER_HF, {"assistant": False})]
    tree = _TREE_NAME.fullmatch(raw)
    if tree is not None:
        budget, depth = int(tree.group(2) or 0), None if tree.group(3) is None else int(tree.group(3))
        if budget < 1 or depth == 0:
            raise ValueError(f"mode {raw!r}: a tree needs a node budget and a depth >= 1, e.g. tree-16 or tree-16x2")
        return [tree_mode(budget, draft_lengths, depth, pipelined=tree.group(1) == PIPELINED_TREE)]
    family, _, k_text = raw.rpartition("-") if raw.rpartition("-")[2].isdigit() else (raw, "", "")
    ks = [int(k_text)] if k_text else list(draft_lengths)
    if family in SERVICE_FAMILIES:
        return [Mode(f"{family}-{k}", RUNNER_SERVICE, SERVICE_FAMILIES[family](k), k) for k in ks]
    if family == "hf":
        return [Mode(f"hf-{k}", RUNNER_HF, _hf_fixed(k), k) for k in ks]
    if family == HF_LOOKUP:  # no draft model: the target alone, drafting by prompt lookup
        return [Mode(f"{HF_LOOKUP}-{k}", RUNNER_HF, {"assistant": False, "prompt_lookup_num_tokens": k}, k) for k in ks]
    known = sorted(
        [
            *SERVICE_MODES,
            *(f"{f}[-K]" for f in SERVICE_FAMILIES),
            f"{TREE}-N[xD]",
            f"{PIPELINED_TREE}-N[xD]",
            "hf[-K]",
            f"{HF_LOOKUP}[-K]",
            HF_DEFAULT,
            HF_TARGET_ONLY,
        ]
    )
    raise ValueError(f"unknown mode {raw!r}; known: {', '.join(known)} (or --custom-mode NAME:key=value,...)")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_custom_mode(spec: str) -> Mode:
    """'NAME:key=value,key=value' -> a service mode with those request options (values: int, float, bool, str)."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name:
        raise ValueError(
            f"--custom-mode {spec!r}: expected NAME:key=value,... (e.g. fast-4:speculation=fixed,draft_length=4)"
        )
    request: dict[str, Any] = {}
    for item in [i.strip() for i in rest.split(",") if i.strip()]:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--custom-mode {spec!r}: {item!r} is not key=value")
        request[key.strip()] = _parse_value(value.strip())
    k = request.get("draft_length")
    return Mode(name, RUNNER_SERVICE, request, int(k) if isinstance(k, int) and k > 0 else None)
