"""Stage 4, the training run: every stage in order, checkpoints, resume, and the summary."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from specd.core.errors import FailedPrecondition
from specd.core.model.draft_checkpoint import target_fingerprint
from specd.core.model.loading import load_pretrained
from specd.tools.distill.config import CHECKPOINT, DistillConfig, bf16_ok, pick_device
from specd.tools.distill.model import DraftTrainer, agreement, build_draft, kl_loss
from specd.tools.distill.output import save_draft_folder
from specd.tools.distill.packing import choose_vocab, make_batch, pack
from specd.tools.distill.teacher import atomic_save, build_data, eos_ids

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def _lr_at(step: int, done: float, cfg: DistillConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr/10 as `done` goes 0 -> 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def _done(step: int, seconds: float, cfg: DistillConfig) -> float:
    """Fraction of the run done: by steps, or by time with --train-minutes (whichever is further)."""
    by_steps = step / cfg.steps if cfg.steps else 1.0
    by_time = seconds / (cfg.train_minutes * 60) if cfg.train_minutes > 0 else 0.0
    return max(by_steps, by_time)


def run_distill(cfg: DistillConfig) -> dict[str, object]:
    """Run every stage; returns the summary written to OUT/distill-summary.json."""
    cfg.validate()
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_distill(cfg)
    finally:
        torch.set_num_threads(threads)


def _head_tokens(
    cfg: DistillConfig, records: list[dict], target: PreTrainedModel, tokenizer: Any, vocab_size: int
) -> Tensor | None:
    """The reduced head's token map [N] (chosen once per work folder, then reused on resume); None: full head."""
    if not cfg.vocab or cfg.vocab >= vocab_size:
        return None
    map_file = cfg.work / "token_map.pt"
    if map_file.is_file():
        return torch.load(map_file, weights_only=True)
    always = sorted(eos_ids(target, tokenizer) | {int(t) for t in tokenizer.all_special_ids if t < vocab_size})
    token_map = choose_vocab(records, vocab_size, cfg.vocab, always)
    atomic_save(token_map, map_file)
    return token_map


def _run_distill(cfg: DistillConfig) -> dict[str, object]:
    started = time.monotonic()
    device = pick_device(cfg.device)
    out, work = Path(cfg.out), cfg.work
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / CHECKPOINT
    if ckpt_path.exists() and not cfg.resume:
        raise FailedPrecondition(
            f"{ckpt_path} exists from an earlier run; pass --resume to continue it, or remove {work}"
        )

    log.info("loading target %s", cfg.target)
    target = load_pretrained(cfg.target)
    torch.nn.Module.to(target.model, device)  # PreTrainedModel.to's wrapper confuses type checkers
    tokenizer = target.tokenizer
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])

    # ---- 1. data ----
    t_data = time.monotonic()
    shards = build_data(cfg, target.model, tokenizer)
    records: list[dict] = []
    for s in shards:
        records += torch.load(s, weights_only=True)
    if not records:
        raise FailedPrecondition("no training data was produced")
    data_seconds = time.monotonic() - t_data
    rng = random.Random(cfg.seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    n_val = max(1, int(len(records) * cfg.val_fraction)) if len(records) > 1 else 0
    val_ids, train_ids = order[:n_val], order[n_val:] or order

    # ---- 2. vocabulary ----
    token_map = _head_tokens(cfg, [records[i] for i in train_ids], target.model, tokenizer, vocab_size)
    inverse: Tensor | None = None
    if token_map is not None:
        inverse = torch.full((vocab_size,), -1, dtype=torch.long)  # target id -> head column, -1: not in the head
        inverse[token_map] = torch.arange(len(token_map))
    train, val = pack([records[i] for i in train_ids], inverse), pack([records[i] for i in val_ids], inverse)
    rows = sum(int(t.shape[0]) for t in train.tgt_idx)
    coverage = (
        float(sum(int((inverse[t] >= 0).sum()) for t in train.tgt_top) / max(rows, 1)) if inverse is not None else 1.0
    )
    log.info(
        "data: %d sequences, %d teacher rows; head covers %.1f%% of the teacher's top-1 tokens",
        len(records),
        rows,
        100 * coverage,
    )

    # ---- 3. draft ----
    draft = build_draft(target.model, cfg.layers, cfg.init, cfg.seed)
    trainer = DraftTrainer(draft, token_map, cfg.train_head).to(device)
    del target
    use_autocast = cfg.autocast == "on" or (cfg.autocast == "auto" and bf16_ok(device))
    params = [p for p in trainer.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    step, history, trained_s = 0, [], 0.0
    if cfg.resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        if any(ckpt["model_key"].get(k) != v for k, v in cfg.model_key().items()):
            raise FailedPrecondition(f"{ckpt_path} was made with {ckpt['model_key']}; resume with the same settings")
        missing = set(trainer.trained_state()) - set(ckpt["trainer"])
        if missing:
            raise FailedPrecondition(f"{ckpt_path} lacks {sorted(missing)[:3]}; it is not a checkpoint of this draft")
        trainer.load_state_dict(ckpt["trainer"], strict=False)
        optim.load_state_dict(ckpt["optim"])
        step, history, trained_s = int(ckpt["step"]), list(ckpt["history"]), float(ckpt.get("seconds", 0.0))
        rng.setstate(ckpt["rng"])
        log.info("resumed at step %d", step)
    initial = history[0] if history else None
    if initial is None:
        kl0, agree0 = (
            agreement(trainer, val, token_map, cfg.seq_len, device, use_autocast) if len(val) else (float("nan"),) * 2
        )
        initial = {"step": 0, "val_kl": kl0, "val_top1": agree0}
        history.append(initial)

    def save_checkpoint() -> None:
        atomic_save(
            {
                "step": step,
                "trainer": trainer.trained_state(),
                "optim": optim.state_dict(),
                "history": history,
                "rng": rng.getstate(),
                "model_key": cfg.model_key(),
                "seconds": trained_s,
            },
            ckpt_path,
        )

    def evaluate_now() -> None:
        if len(val) and history[-1]["step"] != step:
            kl, agree = agreement(trainer, val, token_map, cfg.seq_len, device, use_autocast)
            history.append({"step": step, "train_kl": ema, "val_kl": kl, "val_top1": agree, "seconds": trained_s})
            log.info("step %d: train kl %.3f, val kl %.3f, val top-1 agreement %.3f", step, ema, kl, agree)

    # ---- 4. train ----
    trainer.train()
    ema: float | None = None
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not cfg.progress)
    with bar:
        while _done(step, trained_s, cfg) < 1.0:
            t_step = time.perf_counter()
            batch = make_batch(train, rng.sample(range(len(train)), min(cfg.batch_size, len(train))), cfg.seq_len, rng)
            for g in optim.param_groups:
                g["lr"] = _lr_at(step, _done(step, trained_s, cfg), cfg)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                logits = trainer(batch["x"].to(device))
            loss = kl_loss(logits, batch["cols"].to(device), batch["probs"].to(device), batch["mask"].to(device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            value = loss.item()
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            trained_s += time.perf_counter() - t_step
            last = _done(step, trained_s, cfg) >= 1.0
            if step % cfg.eval_every == 0 or last:
                evaluate_now()
            bar.set_postfix(kl=f"{ema:.3f}", top1=f"{history[-1]['val_top1']:.3f}")
            bar.update()
            if step % cfg.checkpoint_every == 0 or last:
                save_checkpoint()
    if not ckpt_path.exists() or history[-1]["step"] != step:
        evaluate_now()
        save_checkpoint()

    # ---- 5. output ----
    summary: dict[str, object] = {
        "target": str(cfg.target),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "sequences": len(records),
        "teacher_rows": rows,
        "head_tokens": int(token_map.numel()) if token_map is not None else vocab_size,
        "head_coverage_top1": coverage,
        "steps": step,
        "initial": initial,
        "final": history[-1],
        "history": history,
        "data_seconds": data_seconds,
        "train_seconds": trained_s,
        "wall_seconds": time.monotonic() - started,
    }
    meta = {"specd_distill": 1, **target_fingerprint(tokenizer), "steps": step, "final": history[-1]}
    save_draft_folder(trainer, token_map, tokenizer, out, meta)
    (out / "distill-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info("draft written to %s (compact form in %s)", out, out / "compact")
    return summary
