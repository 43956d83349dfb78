"""Stage 1, teacher data: the target's top-k log-probabilities over its own continuations and over text corpora."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from specd.core.errors import FailedPrecondition
from specd.tools.distill.config import SOURCES, DistillConfig, is_generated
from specd.tools.distill.prompts import builtin_continuations, read_prompts, render_prompt
from specd.tools.distill.texts import source_texts

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling code (seconds per process)
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# A record is one sequence: tokens [T] int32, and the teacher's top-k for the
# rows start .. start + R - 1 (row t = the target's distribution of the token
# after tokens[: t + 1]): ids [R, k] int32, logprobs [R, k] float16.


def atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _CaptureTopK(LogitsProcessor):
    """Records the target's top-k log-probabilities at every generation step (scores unchanged)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[Tensor] = []
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        lp = torch.log_softmax(scores.float(), dim=-1)  # [B, V]
        v, i = lp.topk(self.k, dim=-1)  # [B, k]
        self.ids.append(i.to(torch.int32).cpu())
        self.logprobs.append(v.to(torch.float16).cpu())
        return scores


def eos_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@torch.inference_mode()
def generation_records(
    model: PreTrainedModel,
    tokenizer,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> list[dict[str, Tensor | int]]:
    """The target's continuations of a batch of prompts, with its top-k at every generated position."""
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row ends where generation starts
        input_ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    capture = _CaptureTopK(top_k)
    eos = eos_ids(model, tokenizer)
    kwargs: dict[str, object] = dict(do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        logits_processor=LogitsProcessorList([capture]),
        pad_token_id=pad,
        eos_token_id=sorted(eos) or None,
        **kwargs,
    )
    new = out[:, width:].cpu()  # [B, G]
    ids = torch.stack(capture.ids, dim=1)  # [B, G, k]
    lps = torch.stack(capture.logprobs, dim=1)
    records: list[dict[str, Tensor | int]] = []
    for b, p in enumerate(prompts):
        g = new[b].tolist()
        n = len(g)
        for i, t in enumerate(g):
            if t in eos:
                n = i + 1  # keep the end-of-sequence token and the distribution that chose it
                break
        if n == 0:
            continue
        records.append(
            {
                "tokens": torch.tensor(p + g[:n], dtype=torch.int32),
                "start": len(p) - 1,
                "ids": ids[b, :n].clone(),
                "logprobs": lps[b, :n].clone(),
            }
        )
    return records


@torch.inference_mode()
def corpus_records(
    model: PreTrainedModel,
    chunks: Sequence[list[int]],
    *,
    top_k: int,
    batch: int = 8,
) -> list[dict[str, Tensor | int]]:
    """One teacher forward pass per chunk: top-k at every position."""
    records: list[dict[str, Tensor | int]] = []
    for i in range(0, len(chunks), batch):
        group = chunks[i : i + batch]
        width = max(len(c) for c in group)
        x = torch.zeros((len(group), width), dtype=torch.long)
        for b, c in enumerate(group):  # right padding: causal attention never looks at it
            x[b, : len(c)] = torch.tensor(c)
        logits = model(input_ids=x.to(model.device)).logits  # [B, T, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, idx = lp.topk(top_k, dim=-1)  # [B, T, k]
        for b, c in enumerate(group):
            records.append(
                {
                    "tokens": torch.tensor(c, dtype=torch.int32),
                    "start": 0,
                    "ids": idx[b, : len(c)].to(torch.int32).cpu(),
                    "logprobs": v[b, : len(c)].to(torch.float16).cpu(),
                }
            )
    return records


def _chunks_of(texts: Iterator[str], tokenizer, budget: int, seq_len: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    total = 0
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        for i in range(0, len(ids) - 16, seq_len):
            piece = ids[i : i + seq_len]
            chunks.append(piece)
            total += len(piece)
            if total >= budget:
                return chunks
    return chunks


def build_data(cfg: DistillConfig, target: PreTrainedModel, tokenizer) -> list[Path]:
    """Stage 1: shards of teacher records under WORK/data (kept across runs with the same settings)."""
    data_dir = cfg.work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    teacher = target
    if cfg.teacher_dtype == "bfloat16" and target.dtype != torch.bfloat16:
        teacher = _copy_model(target, torch.bfloat16)
    shards: list[Path] = []
    for source in cfg.sources:
        tag = _source_tag(source)
        key_file = data_dir / f"{tag}.settings.json"
        key = cfg.data_key(source)
        if key_file.is_file() and json.loads(key_file.read_text()) != key:
            raise FailedPrecondition(
                f"{data_dir} holds {tag} data built with other settings; remove {data_dir}/{tag}* or use another --work-dir"
            )
        key_file.write_text(json.dumps(key, indent=1))
        if is_generated(source):
            shards += _build_generations(cfg, teacher, tokenizer, data_dir, source)
            continue
        shard = data_dir / f"{tag}.pt"
        if not shard.is_file():
            rng = random.Random(cfg.seed)
            chunks = _chunks_of(source_texts(source, rng), tokenizer, cfg.corpus_tokens, cfg.seq_len)
            if not chunks:
                raise FailedPrecondition(f"--source {source!r} gave no text")
            records: list[dict] = []
            bar = tqdm(total=len(chunks), desc=f"teacher: {tag}", unit="chunk", disable=not cfg.progress)
            with bar:
                for i in range(0, len(chunks), 4):  # 4 x seq_len x V logits at a time bounds memory
                    records += corpus_records(teacher, chunks[i : i + 4], top_k=cfg.teacher_top_k, batch=4)
                    bar.update(len(chunks[i : i + 4]))
            atomic_save(records, shard)
        shards.append(shard)
    if teacher is not target:
        del teacher
    return shards


def _source_tag(source: str) -> str:
    """A file-name-safe name for a source's cached data."""
    if source in SOURCES:
        return source
    kind, path = ("prompts", source[len("prompts:") :]) if source.startswith("prompts:") else ("text", source)
    return f"{kind}-" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:10]


def _build_generations(
    cfg: DistillConfig,
    teacher: PreTrainedModel,
    tokenizer,
    data_dir: Path,
    source: str,
) -> list[Path]:
    """The target's continuations: of chat prompts (generations, prompts:FILE) or of plain-text openings."""
    if source == "generations":
        prompts, chat = read_prompts(cfg.prompts, cfg.num_prompts, cfg.seed), cfg.chat
    elif source.startswith("prompts:"):
        prompts, chat = read_prompts(source[len("prompts:") :], 10**9, cfg.seed), cfg.chat
    else:
        prompts, chat = builtin_continuations(cfg.num_continuations, cfg.seed), False
    rendered = [render_prompt(tokenizer, p, chat)[-(cfg.seq_len - cfg.gen_tokens) :] for p in prompts]
    # Similar lengths together (less padding), batches in a seeded random order (a time-limited run
    # gets a fair sample); the order is fixed by the seed, so shards resume.
    order = sorted(range(len(rendered)), key=lambda i: (len(rendered[i]), i))
    batches = [order[i : i + cfg.gen_batch] for i in range(0, len(order), cfg.gen_batch)]
    random.Random(cfg.seed).shuffle(batches)
    shards = [data_dir / f"{_source_tag(source)}-{i:05d}.pt" for i in range(len(batches))]
    todo = [i for i, s in enumerate(shards) if not s.is_file()]
    deadline = time.monotonic() + cfg.gen_minutes * 60 if cfg.gen_minutes > 0 else math.inf
    bar = tqdm(
        total=len(batches),
        initial=len(batches) - len(todo),
        desc=f"teacher: {source}",
        unit="batch",
        disable=not cfg.progress,
    )
    with bar:
        for i in todo:
            if time.monotonic() > deadline:
                log.info("--gen-minutes reached: %d of %d generation batches done", bar.n, len(batches))
                break
            t0 = time.perf_counter()
            records = generation_records(
                teacher,
                tokenizer,
                [rendered[j] for j in batches[i]],
                max_new_tokens=cfg.gen_tokens,
                temperature=cfg.gen_temperature,
                top_k=cfg.teacher_top_k,
                seed=cfg.seed * 100_003 + i,
            )
            atomic_save(records, shards[i])
            made = sum(len(ids) for r in records if isinstance(ids := r["ids"], Tensor))  # teacher rows
            bar.set_postfix_str(f"{made / (time.perf_counter() - t0):.0f} tok/s")
            bar.update()
    return [s for s in shards if s.is_file()]


def _copy_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    clone = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    clone.load_state_dict(model.state_dict())
    clone.generation_config = model.generation_config
    return clone.to(model.device).eval()
