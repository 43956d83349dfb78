"""The HF baseline: Hugging Face transformers' assisted generation on the same pair, in the bench process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from specd.core.model.draft_checkpoint import install_reduced_head
from specd.core.model.loading import load_pretrained
from specd.tools.bench.modes import Mode
from specd.tools.bench.results import RequestResult, Timeline


class HFStreamer:
    """transformers streamer: the first put is the prompt, each later put one round's tokens."""

    def __init__(self, timeline: Timeline, draft_calls: list[int] | None, drafted: list[int] | None) -> None:
        self.timeline, self.draft_calls, self.drafted = timeline, draft_calls, drafted
        self.seen_prompt = False
        self.calls_before = 0

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
        else:
            self.timeline.add(now, int(value.numel()))
            if self.drafted is not None and self.draft_calls is not None:
                self.drafted.append(self.draft_calls[0] - self.calls_before)  # draft forwards = draft tokens this round
        if self.draft_calls is not None:
            self.calls_before = self.draft_calls[0]

    def end(self) -> None:
        pass


class HFBaseline:
    """transformers' generate() on the same pair, in this process (assisted generation)."""

    def __init__(self, target_model: Any, draft_model: Any | None, *, threads: int, pad_token_id: int) -> None:
        self.target, self.draft, self.threads, self.pad = target_model, draft_model, threads, pad_token_id
        self.draft_calls = [0]
        if draft_model is not None:
            draft_model.register_forward_hook(lambda *_: self.draft_calls.__setitem__(0, self.draft_calls[0] + 1))

    def configure(self, mode: Mode) -> None:
        if self.draft is None or not mode.request.get("assistant", True):
            return
        gen = self.draft.generation_config
        for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
            setattr(gen, key, mode.request.get(key))  # None: transformers' default

    def run(
        self,
        prompt_id: str,
        ids: list[int],
        mode: Mode,
        *,
        temperature: float,
        seed: int,
        max_new_tokens: int,
        stop_at_eos: bool,
    ) -> RequestResult:
        assisted = self.draft is not None and mode.request.get("assistant", True)
        r = RequestResult(prompt_id, drafted=[] if assisted else None)
        timeline = Timeline(r)
        streamer = HFStreamer(timeline, self.draft_calls if assisted else None, r.drafted)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.pad,
            streamer=streamer,
        )
        if temperature > 0:
            kwargs["temperature"] = temperature
        if not stop_at_eos:
            kwargs["eos_token_id"] = []  # keep going past end-of-sequence, as the services' ignore_eos
        if assisted:
            kwargs["assistant_model"] = self.draft
        if mode.request.get("prompt_lookup_num_tokens"):
            kwargs["prompt_lookup_num_tokens"] = int(mode.request["prompt_lookup_num_tokens"])
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)
        r.start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            r.token_ids = [int(t) for t in out[0, len(ids) :].tolist()]
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on
            r.error = f"{type(exc).__name__}: {exc}"
        finally:
            r.end = time.perf_counter()
            torch.set_num_threads(previous)
        return r


def load_inprocess(target_dir: Path, draft_dir: Path | None) -> tuple[Any, Any]:
    hf_logging.set_verbosity_error()  # the HF baseline's per-call notices would drown the progress bars
    target = load_pretrained(target_dir)
    draft = None
    if draft_dir is not None:
        draft = load_pretrained(draft_dir)
        install_reduced_head(draft.model, draft_dir)  # as the draft service does (full-width logits either way)
    return target, draft
