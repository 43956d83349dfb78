"""In-process references the service tests compare against (no gRPC)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.inprocess import GenerationResult, speculative_generate
from specd.core.model.loading import LoadedModel, load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier


@lru_cache(maxsize=4)
def loaded(folder: str) -> LoadedModel:
    return load_pretrained(folder)


def reference(
    target: Path,
    draft: Path | None,
    prompt: list[int],
    params: SamplingParams,
    *,
    max_new_tokens: int,
    draft_length: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
    pipeline: str = "off",
    tree_budget: int = 0,
) -> GenerationResult:
    """What the services must produce: the in-process loop (the coordinator's own) with the same settings."""
    verifier = Verifier(CausalLMRunner(loaded(str(target)).model))
    drafter = ModelDrafter(CausalLMRunner(loaded(str(draft)).model)) if draft is not None else None
    return speculative_generate(
        prompt,
        verifier,
        drafter,
        params,
        draft_length=draft_length if drafter else 0,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        pipeline=pipeline,
        tree_budget=tree_budget if drafter else 0,
    )
