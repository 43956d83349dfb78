"""The repetitive workload and the bench's handling of drafters that learn across requests."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specd.core.model import catalog
from specd.tools.bench import load_prompts, select_prompts
from specd.tools.bench import plan as bench_plan
from specd.tools.bench.args import add_arguments
from specd.tools.bench.learning import warmup_curve
from specd.tools.bench.plan import make_plan
from specd.tools.cli import build_parser
from specd.tools.workloads import REPETITIVE_FILE, repetitive_prompts, to_jsonl


def test_bench_spells_the_catalog_names_alike() -> None:
    assert set(bench_plan.MODEL_FREE_DRAFTS) == set(catalog.MODEL_FREE_DRAFTS)
    assert bench_plan.HYBRID_PREFIX == catalog.HYBRID_PREFIX
    for spec in ("suffix", "suffix+demo", "suffix+/models/draft", "ngram", "demo", "suffix+", "/m/suffix"):
        learns = spec == catalog.SUFFIX or catalog.hybrid_model(spec) is not None
        assert bench_plan.learns_across_requests(spec) == learns, spec


def test_shipped_repetitive_prompts_are_the_generators_output() -> None:
    assert REPETITIVE_FILE.read_text(encoding="utf-8") == to_jsonl(repetitive_prompts())
    assert repetitive_prompts() == repetitive_prompts()  # deterministic


def test_repetitive_prompts_repeat_their_structure_not_their_requests() -> None:
    prompts = load_prompts("repetitive")
    assert {p.category for p in prompts} == {"tool", "sql", "review"}
    assert len({p.prompt for p in prompts}) == len(prompts)  # no request is answered from memory
    by_cat: dict[str, list[str]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p.prompt)
    for texts in by_cat.values():  # each category shares its long preamble
        prefix = texts[0]
        for t in texts[1:]:
            while not t.startswith(prefix):
                prefix = prefix[:-1]
        assert len(prefix) > 100
    # the bench's round-robin interleaves the categories: every third request is of the same kind
    assert [p.category for p in select_prompts(prompts, 6)] == ["tool", "sql", "review"] * 2


def test_warmup_curve_groups_requests_in_order() -> None:
    base = [
        {"prompt_id": str(i), "tokens": 10, "seconds": 1.0, "draft_tokens": 0, "accepted_tokens": 0, "error": None}
        for i in range(6)
    ]
    rows = [
        {
            "prompt_id": str(i),
            "tokens": 10,
            "seconds": 1.0 / (1 + i),
            "draft_tokens": 4,
            "accepted_tokens": i % 5,
            "error": None,
        }
        for i in range(6)
    ]
    curve = warmup_curve(rows, base, groups=3)
    assert [g["requests"] for g in curve] == ["1-2", "3-4", "5-6"]
    assert curve[0]["speedup"] == 20 / 1.5 / 10 and curve[2]["speedup"] > curve[0]["speedup"]
    assert curve[1]["acceptance_rate"] == (2 + 3) / 8


def test_specd_up_serves_suffix_until_a_trained_demo_draft_ships(tmp_path: Path) -> None:
    assert build_parser().parse_args(["up"]).draft == catalog.default_up_draft()
    assert catalog.default_up_draft(tmp_path) == catalog.SUFFIX  # no weights shipped
    (tmp_path / "draft-weights.safetensors").write_bytes(b"")
    assert catalog.default_up_draft(tmp_path) == catalog.DEMO


def test_a_learning_drafter_interleaves_one_drafting_mode_with_target_only_not_two() -> None:
    """Target-only requests never reach the draft, so auto may take turns with them (drift evened out);
    auto and fixed-4 would each learn from the other's outputs."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    common = ["--draft", "suffix", "--prompt-file", "bench", "--prompts", "6", "--interleave", "3"]
    plan = make_plan(parser.parse_args([*common, "--modes", "target-only,auto"]))
    assert [m.name for m in plan.modes] == ["target-only", "auto"] and plan.concurrency == [1]
    with pytest.raises(ValueError, match="one drafting mode at a time"):
        make_plan(parser.parse_args([*common, "--modes", "target-only,auto,fixed-4", "--draft-lengths", "4"]))
