"""The pieces adaptive choices are built from (pure): S(K), the online cost fit, the probe budget."""

from __future__ import annotations

import random

import pytest

from specd.core.rounds.adaptive import LinearCost, ProbeBudget, best_draft_length, expected_speedup


def test_speedup_formula_matches_known_values() -> None:
    assert expected_speedup(0.8, 0.0, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_speedup(0.8, 0.1, 4) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert expected_speedup(0.5, 0.3, 0) == 1.0


@pytest.mark.parametrize(
    "a, c, k_max, expected",
    [(0.9, 0.05, 16, None), (0.6, 0.1, 16, None), (0.05, 0.3, 8, 0), (0.3, 0.9, 8, 0)],
)
def test_best_k_maximises_s(a: float, c: float, k_max: int, expected: int | None) -> None:
    k = best_draft_length(a, c, k_max)
    if expected is not None:
        assert k == expected
    else:
        assert k >= 1 and all(expected_speedup(a, c, k) >= expected_speedup(a, c, j) for j in range(1, k_max + 1))


def test_linear_cost_recovers_base_and_slope_and_waits_for_spread() -> None:
    rng = random.Random(0)
    cost = LinearCost()
    for _ in range(20):
        cost.observe(40, 10.0 + 0.5 * 40)  # one token count only: the slope is unknown
    assert cost.fit() is None and cost.share(8) == 0.0
    for _ in range(300):
        n = rng.choice([8, 16, 40, 80, 160])
        cost.observe(n, (10.0 + 0.5 * n) * rng.uniform(0.95, 1.05))
    base, per_token = cost.fit()
    assert base == pytest.approx(10.0, rel=0.25) and per_token == pytest.approx(0.5, rel=0.1)
    # one more token per session costs per_token * B of a base + per_token * B step
    assert cost.share(1) == pytest.approx(0.5 / 10.5, rel=0.3)
    assert cost.share(32) == pytest.approx(16 / 26, rel=0.1)


def test_a_slope_steeper_than_the_data_allows_is_fitted_through_the_origin() -> None:
    """Mostly 1-token calls at 9 ms and a few slow 2-token ones: the free fit's slope (21 ms per token)
    puts the base below 0. The fit goes through the origin instead and stays near what was measured."""
    cost = LinearCost()
    for i in range(200):
        cost.observe(2, 30.0) if i % 10 == 0 else cost.observe(1, 9.0)
    fitted = cost.fit()
    assert fitted is not None
    base, per_token = fitted
    assert base == 0.0
    assert base + per_token * 1.1 == pytest.approx(9.0 * 0.9 + 30.0 * 0.1, rel=0.1)  # the mean call
    assert base + per_token * 2 < 30.0  # not the 2-token outliers' steepness extrapolated


def test_a_drafting_rounds_fixed_overhead_lowers_s_whatever_k() -> None:
    assert expected_speedup(0.5, 0.0, 1, overhead=0.25) == pytest.approx(1.5 / 1.25)
    # a cheap, rarely right drafter: free it would pay, with a 5% hop and a 13% extra token it does not
    assert best_draft_length(0.15, 0.0, 8) >= 1
    assert best_draft_length(0.15, 0.13, 8, overhead=0.05) == 0
    # a predicted 2% gain is within the estimates' noise: not worth drafting for
    assert best_draft_length(0.2, 0.13, 8, overhead=0.05) == 1
    assert best_draft_length(0.2, 0.13, 8, overhead=0.05, min_gain=1.05) == 0


def test_linear_cost_keeps_its_last_fit_when_the_counts_stop_varying() -> None:
    cost = LinearCost()
    for i in range(100):
        n = 1 + i % 2
        cost.observe(n, 30.0 + 4.0 * n)
    fitted = cost.fit()
    assert fitted is not None and fitted[1] == pytest.approx(4.0, rel=0.01)
    for _ in range(500):  # nobody drafts any more: one-token steps only
        cost.observe(1, 34.0)
    assert cost.fit() == fitted and cost.share(1) == pytest.approx(4.0 / 34.0, rel=0.01)


def test_a_probe_budget_backs_off_and_resets_when_a_session_speculates() -> None:
    probes = ProbeBudget(16, max_every=64)
    rounds = [i for i in range(300) if probes.round_off()]
    assert rounds == [15, 47, 111, 175, 239]  # after 16, then 32, then every 64
    probes.speculating()  # the draft pays somewhere: the next round off probes at once, then waits 32
    assert [i for i in range(40) if probes.round_off()] == [0, 32]
