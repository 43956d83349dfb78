"""`specd bench`: the pure parts (modes, prompts, statistics, reports); runs: tests/services/test_bench_runs.py."""

from __future__ import annotations

import math
import os
import random
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from specd.core.model.loading import load_pretrained
from specd.tools import bench
from specd.tools.bench import (
    BASELINE,
    Mode,
    RequestResult,
    alpha_from_acceptance_length,
    alpha_from_rounds,
    expected_tokens_per_round,
    finish_records,
    load_prompts,
    paired_ratio_interval,
    parse_custom_mode,
    parse_modes,
    percentile,
    select_prompts,
    summarize,
    theoretical_speedup,
)
from specd.tools.bench.cells import warm_up_requests
from specd.tools.bench.cost import measure_cost, measure_ngram_ms
from specd.tools.bench.plan import Plan
from specd.tools.localcluster import process_tree_peak_rss

ROOT = Path(__file__).resolve().parents[3]

# ---- modes ----------------------------------------------------------------------


def test_default_modes_expand_over_draft_lengths() -> None:
    modes = {m.name: m for m in parse_modes(bench.DEFAULT_MODES, [2, 4])}
    assert list(modes) == [
        "target-only",
        "fixed-2",
        "fixed-4",
        "pipelined-2",
        "pipelined-4",
        "auto",
        "hf-2",
        "hf-4",
        "hf-default",
    ]
    assert modes["target-only"].baseline and modes["target-only"].request == {"speculation": "off"}
    assert modes["fixed-4"].request == {"speculation": "fixed", "draft_length": 4, "pipeline": False}
    assert modes["fixed-4"].draft_length == 4
    assert modes["pipelined-2"].request == {"speculation": "fixed", "draft_length": 2, "pipeline": True}
    hf2 = modes["hf-2"]
    assert (
        hf2.hf_baseline
        and hf2.request["num_assistant_tokens"] == 2
        and hf2.request["assistant_confidence_threshold"] == 0
    )
    assert modes["auto"].draft_length is None  # auto picks K itself


def test_auto_may_choose_up_to_the_largest_fixed_k_of_the_run() -> None:
    modes = {
        m.name: m
        for m in bench.cap_adaptive_modes(parse_modes("fixed-2,fixed-6,auto,auto-pipelined,auto-speccache", [4]), [4])
    }
    assert modes["auto-speccache"].request == {"speculation": "auto", "pipeline": "spec-cache", "draft_length": 6}
    assert modes["auto"].request == {"speculation": "auto", "draft_length": 6}
    assert modes["auto-pipelined"].request["draft_length"] == 6 and modes["auto"].draft_length is None
    assert modes["fixed-2"].request["draft_length"] == 2  # fixed modes keep their own K
    named = bench.cap_adaptive_modes(parse_modes("auto", [4], ["mine:speculation=auto,draft_length=3"]), [8])
    assert {m.name: m.request.get("draft_length") for m in named} == {"target-only": None, "auto": 8, "mine": 3}


def test_the_warm_up_runs_every_service_mode_at_every_temperature_greedy_first() -> None:
    modes = parse_modes("fixed-2,auto,hf", [2])
    plan = Plan(modes, [0.7, 0.0, 1.0], [1], [2], [], 64, 1, 1)
    requests = warm_up_requests(plan, modes)
    service = ["target-only", "fixed-2", "auto"]  # the HF baseline warms up on its own
    assert [(m.name, r["temperature"]) for m, r in requests] == [(name, t) for t in (0.0, 0.7, 1.0) for name in service]
    fixed = requests[1][1]
    assert fixed["max_new_tokens"] == 8 and fixed["ignore_eos"] and fixed["draft_length"] == 2


def test_prompt_lookup_hf_baseline_runs_the_target_alone() -> None:
    modes = parse_modes("target-only,hf-lookup", [2, 4])
    assert [(m.name, m.runner, m.draft_length) for m in modes[1:]] == [
        ("hf-lookup-2", "hf", 2),
        ("hf-lookup-4", "hf", 4),
    ]
    assert modes[1].request == {"assistant": False, "prompt_lookup_num_tokens": 2}


def test_baseline_is_always_first_and_custom_modes_are_request_options() -> None:
    modes = parse_modes("fixed-3", [2], ["pipe-4:speculation=fixed,draft_length=4,pipeline=bonus,eager=true"])
    assert [m.name for m in modes] == [BASELINE, "fixed-3", "pipe-4"]
    pipe = modes[2]
    assert pipe.runner == bench.RUNNER_SERVICE and pipe.draft_length == 4
    assert pipe.request == {"speculation": "fixed", "draft_length": 4, "pipeline": "bonus", "eager": True}
    assert parse_custom_mode("x:speculation=auto").draft_length is None


@pytest.mark.parametrize("spec", ["nope", "fixed-2,fixed-2"])
def test_bad_modes_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_modes(spec, [2])


def test_custom_mode_needs_a_name_and_pairs() -> None:
    for bad in ("speculation=fixed", "x:draft_length"):
        with pytest.raises(ValueError):
            parse_custom_mode(bad)


# ---- prompts ----------------------------------------------------------------------


def test_shipped_prompt_set() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 30
    by_cat = Counter(p.category for p in prompts)
    assert set(by_cat) == {"code", "chat", "prose"} and min(by_cat.values()) >= 10
    assert {p.format for p in prompts} == {"chat", "text"}


def test_shipped_edit_prompt_set_repeats_its_code() -> None:
    prompts = load_prompts("edit")
    assert len(prompts) >= 30 and {p.category for p in prompts} == {"edit"}
    assert all("```python\n" in p.prompt for p in prompts)


def test_prompt_set_ships_with_the_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["specd"]
    shipped = bench.default_prompt_file().relative_to(ROOT / "specd")
    assert any(shipped.match(p) for p in patterns)


def test_selection_mixes_categories_in_order() -> None:
    picked = select_prompts(load_prompts(), 6)
    assert [p.category for p in picked] == ["code", "chat", "prose"] * 2
    assert [p.id for p in select_prompts(load_prompts(), 2, ["prose"])] == ["prose-01", "prose-02"]


def test_bad_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "category": "x", "prompt": "hi", "format": "poem"}\n')
    with pytest.raises(ValueError, match="format"):
        load_prompts(f)


# ---- statistics -------------------------------------------------------------------


def test_theoretical_speedup_limits() -> None:
    assert theoretical_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # nothing accepted: pay for the drafts
    assert theoretical_speedup(1.0, 4, 0.0) == pytest.approx(5.0)  # all accepted, free draft: K + 1
    assert theoretical_speedup(0.5, 2, 0.0) == pytest.approx(1 + 0.5 + 0.25)


def test_alpha_from_rounds_is_the_truncated_geometric_mle() -> None:
    # rounds of K=4: accepted 4 (no rejection seen), 1, 0 -> a = 5 / (5 + 2)
    assert alpha_from_rounds([4, 4, 4], [4, 1, 0]) == pytest.approx(5 / 7)
    assert alpha_from_rounds([0, 0], [0, 0]) is None  # nothing drafted


def test_alpha_from_acceptance_length_inverts_the_expectation() -> None:
    for a in (0.1, 0.5, 0.9):
        length = expected_tokens_per_round(a, 4)
        assert alpha_from_acceptance_length(length, 4) == pytest.approx(a, abs=1e-9)
    assert alpha_from_acceptance_length(1.0, 4) == 0.0
    assert alpha_from_acceptance_length(5.0, 4) == 1.0


def test_a_paired_bootstrap_gives_the_ratios_spread_over_prompts() -> None:
    """auto's rate over the best of the other modes, resampling prompts: the same data is exactly 1, a mode
    twice as fast on every prompt exactly 2, noise widens the interval around the ratio on all prompts,
    and modes that ran different prompts have none."""
    rng = random.Random(5)
    prompts = [f"p{i}" for i in range(12)]
    base = {p: (48.0, rng.uniform(0.3, 0.6)) for p in prompts}
    assert paired_ratio_interval({"auto": base, "fixed-2": dict(base)}, "auto", ["fixed-2"]) == (1.0, 1.0)
    fast = {p: (t, s / 2) for p, (t, s) in base.items()}
    lo, hi = paired_ratio_interval({"auto": fast, "fixed-2": base, "fixed-4": base}, "auto", ["fixed-2", "fixed-4"])
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    noisy = {p: (t, s * rng.uniform(0.7, 1.3)) for p, (t, s) in base.items()}
    lo, hi = paired_ratio_interval({"auto": noisy, "fixed-2": base}, "auto", ["fixed-2"], level=0.9)
    whole = (sum(t for t, _ in noisy.values()) / sum(s for _, s in noisy.values())) / (
        sum(t for t, _ in base.values()) / sum(s for _, s in base.values())
    )
    assert lo < whole < hi and hi - lo > 0.05
    narrower = paired_ratio_interval({"auto": noisy, "fixed-2": base}, "auto", ["fixed-2"], level=0.5)
    assert narrower is not None and lo < narrower[0] < narrower[1] < hi
    assert paired_ratio_interval({"auto": base, "fixed-2": {"other": (48.0, 0.4)}}, "auto", ["fixed-2"]) is None
    assert paired_ratio_interval({"auto": base}, "auto", ["fixed-2"]) is None


def test_percentile_matches_numpy_linear() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))


def _result(
    pid: str, rounds: list[int], *, stats: dict | None = None, drafted: list[int] | None = None
) -> RequestResult:
    r = RequestResult(
        pid,
        token_ids=list(range(sum(rounds))),
        round_tokens=rounds,
        stats=stats,
        drafted=drafted,
        ttft_s=0.01,
        itl_s=[0.002] * (sum(rounds) - rounds[0]),
    )
    return r


def test_summarize_fixed_k_from_stream_and_stats() -> None:
    # max_new_tokens 8, K 2: draft budgets 2, 2, 2, 0 (the last token needs no draft) -> rounds commit 3, 1, 3, 1
    stats = {"rounds": 4, "drafts": 3, "draft_tokens": 6, "accepted_tokens": 4, "target_only_rounds": 0}
    rec = summarize(
        Mode("fixed-2", "service", {}, 2),
        0.0,
        1,
        [_result("p", [3, 1, 3, 1], stats=stats)],
        2.0,
        max_new_tokens=8,
        cost={"c": 0.5, "target_ms": 10.0, "target_verify_ms": {"2": 12.0}},
    )
    assert rec["tokens_per_s"] == 4.0
    assert rec["acceptance_rate"] == pytest.approx(4 / 6) and rec["acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert rec["accepted_per_position"] == [2, 2] and rec["acceptance_per_position"] == pytest.approx([2 / 3, 2 / 3])
    assert rec["alpha_method"] == "rounds" and rec["alpha"] == pytest.approx(4 / 5)  # 1 round saw a rejection
    assert rec["theoretical_speedup"] == pytest.approx(theoretical_speedup(4 / 5, 2, 0.5))
    assert rec["theoretical_model"] == "S(K)"
    assert rec["theoretical_speedup_measured_verify"] == pytest.approx(expected_tokens_per_round(0.8, 2) / (1 + 1.2))
    assert rec["ttft_ms_p50"] == pytest.approx(10.0) and rec["itl_ms_p50"] == pytest.approx(2.0)


def test_speccache_mode_and_hits_per_outcome() -> None:
    (mode,) = parse_modes("speccache-3", [4])[1:]
    assert mode.name == "speccache-3" and mode.draft_length == 3
    assert mode.request == {"speculation": "fixed", "draft_length": 3, "pipeline": "spec-cache"}
    # two requests of K = 2, 4 drafting rounds each: accepted 2, 2, 1, 0 and 2, 0, 0, 1
    stats = [
        {
            "rounds": 4,
            "drafts": 4,
            "draft_tokens": 8,
            "accepted_tokens": acc,
            "pipeline_hits": sum(hits.values()),
            "pipeline_hits_by_outcome": hits,
            "accepted_per_position": per,
        }
        for acc, per, hits in [
            (5, [3, 2], {"2:bonus": 1, "0:recovered": 1}),
            (3, [2, 1], {"2:bonus": 1, "1:recovered": 1}),
        ]
    ]
    results = [_result("a", [3, 3, 2, 1], stats=stats[0]), _result("b", [3, 1, 1, 2], stats=stats[1])]
    rec = summarize(mode, 0.0, 1, results, 1.0, max_new_tokens=9, cost=None)
    assert rec["pipeline_hits_by_outcome"] == {"0:recovered": 1, "1:recovered": 1, "2:bonus": 2}  # in verdict order
    assert rec["pipeline_hit_rate_by_outcome"] == pytest.approx(
        {"0:recovered": 1 / 8, "1:recovered": 1 / 8, "2:bonus": 2 / 8}
    )
    assert sum(rec["pipeline_hit_rate_by_outcome"].values()) == pytest.approx(rec["pipeline_hit_rate"])
    # verdicts: accepted 0 in 3 rounds, 1 in 2, 2 in 3 (from the per-position counts 5, 3 of 8 drafts)
    assert rec["pipeline_coverage_by_outcome"] == pytest.approx(
        {"0:recovered": 1 / 3, "1:recovered": 1 / 2, "2:bonus": 2 / 3}
    )
    fixed = summarize(parse_modes("fixed-2", [4])[1], 0.0, 1, results[:1], 1.0, max_new_tokens=9, cost=None)
    assert fixed["pipeline_hit_rate_by_outcome"] is not None  # (the stats said so)
    rec_no = summarize(mode, 0.0, 1, [_result("c", [3], stats={"drafts": 1})], 1.0, max_new_tokens=3, cost=None)
    assert rec_no["pipeline_hits_by_outcome"] is None and rec_no["pipeline_coverage_by_outcome"] is None


def test_interleave_slices_cover_the_prompts_and_keep_clients_busy() -> None:
    assert bench.interleave_slices(10, 1, 1) == [range(0, 10)]
    assert bench.interleave_slices(10, 1, 3) == [range(0, 3), range(3, 7), range(7, 10)]
    assert bench.interleave_slices(10, 4, 3) == [range(0, 5), range(5, 10)]  # >= 4 prompts per slice
    assert bench.interleave_slices(3, 8, 4) == [range(0, 3)]


def test_ngram_cost_is_timed_per_proposed_token(tiny_pair: tuple[Path, Path]) -> None:
    target, _ = tiny_pair
    prompt = [5, 6, 7, 8, 9, 10, 11] * 12 + [5, 6]  # the lookup finds 7, 8, 9, 10 after "5 6"
    ngram_ms = measure_ngram_ms(prompt, samples=5)
    assert 0 < ngram_ms < 50
    cost = measure_cost(
        load_pretrained(target).model, None, prompt, target_threads=1, draft_threads=1, samples=5, draft_lengths=[2]
    )
    assert cost["draft_ms"] > 0 and cost["c"] == pytest.approx(cost["draft_ms"] / cost["target_ms"])
    assert set(cost["target_verify_ms"]) == {"2"}


def test_summarize_falls_back_to_acceptance_length_when_rounds_do_not_add_up() -> None:
    # auto: K unknown per round; a is solved from the acceptance length at the mean draft length
    stats = {"rounds": 2, "drafts": 2, "draft_tokens": 6, "accepted_tokens": 2, "target_only_rounds": 0}
    rec = summarize(
        Mode("auto", "service", {}), 0.0, 1, [_result("p", [2, 2], stats=stats)], 1.0, max_new_tokens=4, cost=None
    )
    assert rec["alpha_method"] == "length" and rec["mean_draft_length"] == 3.0
    assert expected_tokens_per_round(rec["alpha"], 3.0) == pytest.approx(2.0)


def test_mixed_speedup_weighs_rounds_that_did_not_draft() -> None:
    assert bench.mixed_speedup(0.6, 4, 0.1, 10, 10) == pytest.approx(theoretical_speedup(0.6, 4, 0.1))
    assert bench.mixed_speedup(0.6, 4, 0.1, 0, 10) == 1.0  # never drafted: target-only
    one = expected_tokens_per_round(0.6, 4)
    assert bench.mixed_speedup(0.6, 4, 0.1, 5, 10) == pytest.approx((5 * one + 5) / (5 * 1.4 + 5))


def test_summarize_hf_baseline_counts_draft_forwards() -> None:
    rec = summarize(
        Mode("hf-2", "hf", {"num_assistant_tokens": 2}, 2),
        0.0,
        1,
        [_result("p", [3, 1, 1], drafted=[2, 2, 1])],
        1.0,
        max_new_tokens=5,
        cost=None,
    )
    assert (rec["drafts"], rec["draft_tokens"], rec["accepted_tokens"]) == (3, 5, 2)
    assert rec["theoretical_speedup"] is None  # no measured c


def test_finish_records_speedup_and_greedy_check() -> None:
    def rec(mode: str, runner: str, tps: float) -> dict:
        return {
            "mode": mode,
            "runner": runner,
            "temperature": 0.0,
            "concurrency": 1,
            "tokens_per_s": tps,
            "theoretical_speedup": 2.0 if mode != BASELINE else None,
            "speedup": None,
            "efficiency": None,
            "theoretical_speedup_measured_verify": 3.0 if mode != BASELINE else None,
        }

    records = [rec(BASELINE, "service", 10.0), rec("fixed-2", "service", 15.0), rec("hf-2", "hf", 12.0)]
    outputs = {
        ("", BASELINE, 0.0, 1): {"a": [1, 2, 3]},
        ("", "fixed-2", 0.0, 1): {"a": [1, 2, 4]},
        ("", "hf-2", 0.0, 1): {"a": [1, 2, 3]},
    }
    summary = finish_records(records, outputs)
    assert records[1]["speedup"] == 1.5 and records[1]["efficiency"] == 0.75
    assert records[1]["efficiency_measured_verify"] == 0.5  # 1.5 / S(K) of 3.0 at the measured verify cost
    assert records[1]["greedy_identical"] is False and records[1]["greedy_mismatches"][0]["first_diff"] == 2
    assert records[2]["greedy_identical"] is True
    assert summary["identical"] is False and summary["peer_identical"] is True


def test_batched_and_unbatched_setups_each_have_their_baseline_and_a_gain() -> None:
    def rec(services: str, mode: str, c: int, tps: float) -> dict:
        return {
            "services": services,
            "mode": mode,
            "runner": "service",
            "temperature": 0.0,
            "concurrency": c,
            "tokens_per_s": tps,
            "theoretical_speedup": None,
            "speedup": None,
            "efficiency": None,
        }

    records = [
        rec("batched", BASELINE, 8, 40.0),
        rec("batched", "auto", 8, 44.0),
        rec("unbatched", BASELINE, 8, 10.0),
        rec("unbatched", "auto", 8, 11.0),
        rec("batched", BASELINE, 1, 10.0),
    ]
    outputs = {(r["services"], r["mode"], 0.0, r["concurrency"]): {"a": [1, 2]} for r in records}
    summary = finish_records(records, outputs)
    assert records[1]["speedup"] == pytest.approx(1.1) and records[3]["speedup"] == pytest.approx(1.1)
    assert summary["identical"] is True and summary["records_checked"] == 5
    gains = {g["mode"]: g["gain"] for g in bench.batching_gains(records)}
    assert gains == {BASELINE: 4.0, "auto": 4.0}
    cols, rows = bench.concurrency_table(records, 0.0)
    assert cols == [1, 8] and dict(rows)[f"{BASELINE} [batched]"] == {8: 40.0, 1: 10.0}


def test_peak_rss_of_this_process() -> None:
    assert (process_tree_peak_rss(os.getpid()) or 0) > 10 * 2**20
