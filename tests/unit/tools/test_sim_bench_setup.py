"""`specd bench --sim PROFILE`, in-process: profiles, the cost model, overhead quantiles (a run: tests/services/test_sim_bench.py)."""

from __future__ import annotations

import math
from argparse import Namespace

import pytest

from specd.core.model.sim import load_profile
from specd.tools.bench.overhead import add, difference, metrics_address, quantile_ms
from specd.tools.bench.sim import SIM_MODES, apply_sim, sim_cost, sim_spec
from specd.tools.cli import main


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
