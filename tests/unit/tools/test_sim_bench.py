"""`specd bench --sim PROFILE` and the emulated services behind it (contract in issue 16)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from specd.core.sim import list_profiles, load_profile, parse_sim_spec
from specd.tools.bench.overhead import add, difference, metrics_address, quantile_ms
from specd.tools.bench.sim import SIM_MODES, apply_sim, sim_cost, sim_spec
from specd.tools.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_list_sim_profiles_prints_one_name_per_line():
    out = subprocess.run(
        [sys.executable, "-m", "specd.tools.cli", "bench", "--list-sim-profiles"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.splitlines() == list_profiles()


def test_bad_profile_is_a_setup_error(tmp_path):
    assert main(["bench", "--sim", "no-such-profile", "--json", str(tmp_path / "b.json")]) == 2


def test_apply_sim_points_both_services_at_the_profile():
    args = Namespace(sim="h100-8b,agreement=0.6", target="demo", draft="demo", target_threads=2, draft_threads=1,
                     no_inprocess=False, modes="DEFAULT")  # fmt: skip
    profile = apply_sim(args, "DEFAULT")
    assert args.target == args.draft == profile.spec == "sim:h100-8b,agreement=0.6"
    assert (args.target_threads, args.draft_threads, args.no_inprocess, args.modes) == (1, 1, True, SIM_MODES)
    assert sim_spec("sim:x") == "sim:x" and sim_spec("x") == "sim:x"


def test_sim_cost_is_the_profiles_cost_model():
    profile = load_profile("h100-tp2-70b")
    cost = sim_cost(profile, 100, [2, 4])
    t, d = profile.target.cost, profile.draft.cost
    assert cost["target_ms"] == pytest.approx(t.forward_ms([1], [100]))
    assert cost["c"] == pytest.approx(d.forward_ms([1], [100]) / t.forward_ms([1], [100]))
    assert cost["target_verify_ms"]["4"] == pytest.approx(t.forward_ms([5], [104]))
    assert "emulated" in cost["source"]


def test_overhead_quantiles_interpolate_within_buckets_like_prometheus():
    # cumulative counts: 10 rounds <= 1 ms, 90 <= 2.5 ms, 100 <= 5 ms
    before = {0.001: 5.0, 0.0025: 5.0, 0.005: 5.0, math.inf: 5.0}
    after = {0.001: 15.0, 0.0025: 95.0, 0.005: 105.0, math.inf: 105.0}
    cell = difference(after, before)
    assert quantile_ms(cell, 0.5) == pytest.approx(1.0 + 1.5 * (50 - 10) / 80)
    assert quantile_ms(cell, 0.99) == pytest.approx(2.5 + 2.5 * (99 - 90) / 10)
    assert quantile_ms(add(cell, cell), 0.5) == pytest.approx(quantile_ms(cell, 0.5))
    assert quantile_ms({0.001: 0.0, math.inf: 0.0}, 0.5) is None
    assert quantile_ms({0.001: 0.0, math.inf: 4.0}, 0.5) == pytest.approx(1.0)  # past the last bound
    assert metrics_address(["x\n", "specd-coordinator metrics on 127.0.0.1:4567\n"]) == "127.0.0.1:4567"
    assert metrics_address(["nothing"]) is None


def test_bench_on_an_emulated_pair_writes_the_contract_records(tmp_path):
    """End to end: three services on sim:PROFILE, every mode of the contract, records and labels."""

    out = tmp_path / "bench.json"
    spec = "h100-8b,vocab_size=2048,time_scale=0.5"
    rc = main(
        [
            "bench",
            "--sim",
            spec,
            "--cache-dir",
            str(tmp_path / "cache"),
            "--modes",
            "target-only,fixed-4,pipelined-4,postverify-4,speccache-4,auto",
            "--prompts",
            "2",
            "--max-new-tokens",
            "12",
            "--temperatures",
            "0,1",
            "--concurrency",
            "1,2",
            "--json",
            str(out),
            "--no-progress",
            "--strict",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    records = report["records"]
    assert {r["mode"] for r in records} == {
        "target-only",
        "fixed-4",
        "pipelined-4",
        "postverify-4",
        "speccache-4",
        "auto",
    }
    assert len(records) == 6 * 2 * 2
    for r in records:
        for key in (
            "mode",
            "concurrency",
            "temperature",
            "tokens_per_s",
            "speedup",
            "acceptance_rate",
            "round_overhead_ms_p50",
            "round_overhead_ms_p99",
        ):
            assert key in r, key
        assert r["errors"] == 0 and r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["round_overhead_ms_p50"] is not None and 0 <= r["round_overhead_ms_p50"] <= r["round_overhead_ms_p99"]
    spec_records = [r for r in records if r["mode"] not in ("target-only", "auto")]  # auto may not draft yet
    assert all(r["acceptance_rate"] is not None and r["acceptance_rate"] > 0.2 for r in spec_records)
    assert report["meta"]["correctness"]["identical"] is True  # greedy equal to target-only in every mode
    meta = report["meta"]["emulated"]
    assert meta["label"] == "emulated" and meta["spec"] == parse_sim_spec("sim:" + spec).spec
    assert report["meta"]["cost"]["service"]["c"] == pytest.approx(
        sim_cost(parse_sim_spec("sim:" + spec), 1, [4])["c"], rel=0.05
    )
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# specd bench (emulated: h100-8b)") and "Every figure below is emulated" in md
    assert "overhead p50 ms" in md
    cache = [r for r in records if r["mode"] == "speccache-4"]
    assert all(sum(r["pipeline_hits_by_outcome"].values()) == r["pipeline_hits"] for r in cache)
    assert any(r["pipeline_hits"] for r in cache) and "Pipeline hits by the verdict" in md
    assert out.with_suffix(".png").stat().st_size > 0
