"""The bench on the repetitive workload with a suffix draft: requests in sequence, a fresh draft per mode."""

from __future__ import annotations

from pathlib import Path

from tests.bench_run import RunBench


def test_bench_runs_the_repetitive_set_in_sequence_with_a_fresh_suffix_draft_per_mode(
    tiny_pair: tuple[Path, Path], tmp_path: Path, run_bench: RunBench
) -> None:
    target, _ = tiny_pair
    report, out = run_bench(
        "--target",
        str(target),
        "--draft",
        "suffix",
        "--prompt-file",
        "repetitive",
        "--modes",
        "target-only,auto,fixed-4",
        "--draft-lengths",
        "4",
        "--prompts",
        "5",
        "--warm-requests",
        "2",
        "--max-new-tokens",
        "8",
        "--temperatures",
        "0",
        "--target-threads",
        "1",
        "--no-inprocess",  # the tiny model's 512-token context cannot also time a verify after these prompts
        "--cache-dir",
        str(tmp_path),
    )
    meta, records = report["meta"], report["records"]
    assert meta["settings"]["concurrency"] == [1]  # a learning drafter's requests run in sequence
    assert meta["settings"]["learning_draft"] is True and meta["settings"]["warm_requests"] == 2
    assert [r["mode"] for r in records] == ["target-only", "auto", "fixed-4"]
    for r in records:
        assert r["errors"] == 0 and r["prompts"] == 3 and r["completion_tokens"] == 3 * 8  # after the 2 warm ones
        assert {"mode", "tokens_per_s", "speedup", "acceptance_rate"} <= set(r)
        assert [p["prompt_id"] for p in r["per_request"]] == meta["settings"]["prompt_ids"]  # all 5, in order
        assert len(r["warmup_curve"]) == 5
    assert all(r["greedy_identical"] is True for r in records)
    assert "Warm-up curve" in out.with_suffix(".md").read_text()
