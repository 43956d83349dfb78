"""The prompt sets: shipped JSONL files, selection round-robin over categories, tokenization."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str  # code | chat | prose (any label works)
    format: str  # "chat": sent as a user message through the chat template; "text": plain continuation
    prompt: str


def default_prompt_file() -> Path:
    return shipped_prompt_file("bench")


def shipped_prompt_file(name: str) -> Path:
    """A prompt set shipped with specd: 'bench' (code, chat, prose) or 'edit' (edit code given in the prompt)."""
    return Path(__file__).resolve().parents[2] / "prompts" / f"{name}.jsonl"


def load_prompts(path: Path | str | None = None) -> list[BenchPrompt]:
    """The prompt set: one JSON object per line with id, category, format (chat|text), prompt.

    path: a file, or the name of a shipped set ('bench', 'edit'); default 'bench'.
    """
    if path and not Path(path).exists() and shipped_prompt_file(str(path)).exists():
        path = shipped_prompt_file(str(path))
    path = Path(path) if path else default_prompt_file()
    out: list[BenchPrompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                p = BenchPrompt(
                    str(obj["id"]), str(obj["category"]), str(obj.get("format", "text")), str(obj["prompt"])
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: need a JSON object with id, category, prompt ({exc})") from exc
            if p.format not in ("chat", "text"):
                raise ValueError(f"{path}:{n}: format must be chat or text (got {p.format!r})")
            if not p.prompt:
                raise ValueError(f"{path}:{n}: empty prompt")
            out.append(p)
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: prompt ids must be unique")
    return out


def select_prompts(prompts: Sequence[BenchPrompt], n: int, categories: Sequence[str] = ()) -> list[BenchPrompt]:
    """The first n prompts taken round-robin over the categories (so any n mixes them), in file order within each."""
    pool = [p for p in prompts if not categories or p.category in categories]
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in pool:
        by_cat.setdefault(p.category, []).append(p)
    out: list[BenchPrompt] = []
    queues = [list(v) for v in by_cat.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def tokenize_prompt(tokenizer: Any, p: BenchPrompt) -> list[int]:
    """Prompt token IDs, the same for every mode (the services get IDs, not text)."""
    if p.format == "chat" and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(p.prompt)["input_ids"]]
