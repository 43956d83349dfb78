"""What `specd distill` writes: the model folder and its compact form (format: specd.core.model.draft_checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from specd.core.model.draft_checkpoint import REDUCED_HEAD_FILE, write_compact, write_reduced_head
from specd.core.model.loading import share_readable
from specd.tools.distill.model import DraftTrainer, borrowed_names


def save_draft_folder(
    trainer: DraftTrainer,
    token_map: Tensor | None,
    tokenizer,
    out: Path,
    meta: dict[str, object],
) -> None:
    """OUT: an HF folder (weights float32) + reduced-head.safetensors + compact/ (what to ship)."""
    draft = trainer.draft
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.tmp"
    draft.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    head_file = out / REDUCED_HEAD_FILE
    if token_map is not None:
        write_reduced_head(out, token_map, trainer.head if trainer.head.requires_grad else None)
    elif head_file.exists():
        head_file.unlink()
    export_compact(trainer, token_map, out / "compact", meta)
    share_readable(out)  # save_pretrained writes private (0600) weights; a service may run as another user


def export_compact(trainer: DraftTrainer, token_map: Tensor | None, dest: Path, meta: dict[str, object]) -> int:
    """Write only what cannot be rebuilt from the target (the compact form); returns the bytes written."""
    draft = trainer.draft
    borrowed = borrowed_names(draft)
    weights = {n: p for n, p in draft.state_dict().items() if n not in borrowed and p.is_floating_point()}
    head = trainer.head if trainer.head.requires_grad else None
    info = {**meta, "config": draft.config.to_dict(), "borrowed": sorted(borrowed)}
    return write_compact(dest, weights, token_map, head, info)
