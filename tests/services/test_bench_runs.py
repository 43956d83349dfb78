"""`specd bench` runs: a smoke run on the tiny pair, a batched/unbatched run with tracing, peak RSS.

The smoke run uses the session's tiny cluster (--address), so it costs a few
seconds on top of the services the other service tests start anyway. The pure
parts (modes, prompts, statistics, reports) are in tests/unit/tools/test_bench.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.tools.bench import (
    BASELINE,
)
from tests.bench_run import RunBench


def test_bench_smoke_on_the_tiny_pair(tiny_cluster, tiny_pair: tuple[Path, Path], run_bench: RunBench) -> None:
    target, draft = tiny_pair
    report, out = run_bench(
        "--address",
        tiny_cluster.address,
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--modes",
        "target-only,fixed,pipelined-3,auto,hf,hf-lookup",
        "--draft-lengths",
        "2",
        "--prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--temperatures",
        "0,0.7",
        "--concurrency",
        "1,2",
        "--target-threads",
        "1",
        "--draft-threads",
        "1",
        "--cost-samples",
        "3",
        "--interleave",
        "3",
    )
    records = report["records"]
    # 4 service modes x 4 cells + the two peers (assisted, prompt lookup) at 1 client x 2 temperatures
    assert len(records) == 4 * 4 + 2 * 2
    # modes took turns over 3 one-prompt slices at 1 client; 2 clients keep one slice (3 // 2 = 1)
    assert {(r["concurrency"], r["interleave_slices"]) for r in records} == {(1, 3), (2, 1)}
    for r in records:
        for key in (
            "mode",
            "tokens_per_s",
            "speedup",
            "acceptance_rate",
            "acceptance_length",
            "acceptance_per_position",
            "cost_ratio",
            "theoretical_speedup",
            "efficiency",
            "ttft_ms_p50",
            "itl_ms_p50",
            "itl_ms_p99",
            "greedy_identical",
            "temperature",
            "concurrency",
        ):
            assert key in r, key
        assert r["errors"] == 0 and r["completion_tokens"] == 3 * 8  # past EOS: equal work in every mode
    base = [r for r in records if r["mode"] == BASELINE]
    assert all(r["speedup"] == pytest.approx(1.0) for r in base)
    fixed = next(r for r in records if r["mode"] == "fixed-2")
    assert fixed["drafts"] > 0 and fixed["theoretical_speedup"] is not None and fixed["cost_ratio"] > 0
    assert len(fixed["acceptance_per_position"]) == 2 and fixed["per_position_source"] == "stats"
    assert fixed["pipeline_hits"] == 0
    greedy = [r for r in records if r["temperature"] == 0.0]
    assert all(r["greedy_identical"] is True for r in greedy if r["runner"] == "service")
    lookup = next(r for r in greedy if r["mode"] == "hf-lookup-2")
    assert lookup["greedy_identical"] is True and lookup["tokens_per_s"] > 0
    assert all(r["greedy_identical"] is None for r in records if r["temperature"] != 0.0)
    correctness = report["meta"]["correctness"]
    assert correctness["identical"] is True and correctness["records_checked"] == len(greedy)
    assert report["meta"]["cost"]["service"]["c"] > 0
    assert set(report["meta"]["cost"]["service"]["target_verify_ms"]) == {"2", "3"}  # pipelined-3's K too
    assert all(r["theoretical_speedup_measured_verify"] for r in records if r["mode"] in ("fixed-2", "pipelined-3"))
    md = out.with_suffix(".md").read_text()
    assert "| T | clients | mode | tok/s | speed-up" in md and "`fixed-2`" in md and "Greedy check" in md
    # The thread and OpenMP settings the services ran under (issue 28), from the bench's own torch.
    runtime = report["meta"]["machine"]["openmp"]["openmp"]
    assert runtime in ("GNU libgomp", "Intel libiomp5", "LLVM libomp")
    assert f"OpenMP {runtime}, " in md
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_batching_both_and_tracing_overhead(
    tiny_pair: tuple[Path, Path], tmp_path: Path, run_bench: RunBench
) -> None:
    """Its own services, twice (batched, --max-batch 1), tracing to an in-process OTLP receiver."""

    target, draft = tiny_pair
    report, out = run_bench(
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--modes",
        "target-only,fixed",
        "--draft-lengths",
        "2",
        "--prompts",
        "3",
        "--max-new-tokens",
        "6",
        "--temperatures",
        "0",
        "--concurrency",
        "1,3",
        "--target-threads",
        "1",
        "--no-inprocess",
        "--batching",
        "both",
        "--tracing-overhead",
        "--tracing-repeats",
        "1",
    )
    records, meta = report["records"], report["meta"]
    assert sorted({r["services"] for r in records}) == ["batched", "unbatched"] and len(records) == 2 * 2 * 2
    assert all(r["errors"] == 0 and r["greedy_identical"] is True for r in records)
    gains = meta["batching_gains"]
    assert {(g["mode"], g["concurrency"]) for g in gains} == {(m, c) for m in (BASELINE, "fixed-2") for c in (1, 3)}
    tro = meta["tracing_overhead"]
    assert tro["mode"] == "fixed-2" and tro["errors"] == 0 and tro["requests_per_variant"] == 3
    assert tro["tokens_per_s_on"] > 0 and tro["tokens_per_s_off"] > 0
    # traced requests reached the receiver: Generate + rounds + draft/target spans (+ phases) per request
    assert tro["spans_received"] >= 3 * 6
    assert set(meta["peak_rss_mb"]) >= {"target [batched]", "target [unbatched]", "bench"}
    md = out.with_suffix(".md").read_text()
    assert "Tokens/s against concurrent clients" in md and "`fixed-2 [unbatched]`" in md
    assert "Batching: tokens/s" in md and "Tracing overhead" in md


def test_cluster_reports_peak_rss(tiny_cluster) -> None:
    peaks = tiny_cluster.peak_rss_bytes()
    assert set(peaks) == {"target", "draft", "coordinator"}
    assert all(v is not None and v > 10 * 2**20 for v in peaks.values())
