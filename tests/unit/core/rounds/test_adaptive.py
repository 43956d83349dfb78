"""The adaptive draft-length controller (pure)."""

from __future__ import annotations

import random

import pytest

from specd.core.rounds.adaptive import (
    AdaptiveDraftLength,
    Estimate,
    LinearCost,
    ProbeBudget,
    ServiceEstimates,
    best_draft_length,
    expected_speedup,
)


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


def _simulate(a_true: float, c: float, rounds: int = 400, seed: int = 0) -> tuple[AdaptiveDraftLength, list[int]]:
    rng = random.Random(seed)
    ctl = AdaptiveDraftLength(k_max=8, acceptance=Estimate(0.5, 4.0), cost_ratio=Estimate(c, 4.0))
    ks = []
    for _ in range(rounds):
        k = ctl.next_k()
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < a_true:
            accepted += 1
        ctl.observe(k, accepted, draft_ms=c * 10.0 * k, verify_ms=10.0)
    return ctl, ks


def test_controller_learns_acceptance_and_picks_long_drafts_for_good_drafts() -> None:
    ctl, ks = _simulate(0.9, 0.05)
    assert ctl.acceptance.value == pytest.approx(0.9, abs=0.08)
    assert sum(ks[-100:]) / 100 >= 5


def test_controller_stops_speculating_when_it_cannot_pay_and_probes() -> None:
    _, ks = _simulate(0.02, 0.3)
    tail = ks[-160:]
    assert tail.count(0) >= 140  # mostly target-only
    assert 1 in tail  # but it probes again


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


def test_k_shrinks_as_the_batch_share_grows() -> None:
    ctl = AdaptiveDraftLength(k_max=8, acceptance=Estimate(0.7, 32), cost_ratio=Estimate(0.05, 32))
    ks = [ctl.next_k(share) for share in (0.0, 0.1, 0.3, 0.6, 0.9)]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 4 and ks[-1] == 0


def test_a_new_session_follows_the_live_service_estimate_until_its_own_evidence_grows() -> None:
    service_a, service_c = Estimate(0.5, 2.0), Estimate(0.1, 2.0)
    ctl = AdaptiveDraftLength(
        k_max=8,
        acceptance=Estimate(0.5),
        cost_ratio=Estimate(0.1),
        service_acceptance=service_a,
        service_cost_ratio=service_c,
    )
    assert ctl.next_k() >= 1  # nothing known yet: the optimistic guess drafts
    for _ in range(8):  # the other sessions keep rejecting: the shared estimate falls ...
        service_a.update(0.0)
    assert ctl.expected_acceptance == pytest.approx(service_a.value) and ctl.next_k() == 0  # ... read live
    shared_before = service_a.value
    for _ in range(64):  # this session's own text is predictable: its evidence takes over
        ctl.observe(8, 8, draft_ms=1.0, verify_ms=10.0)
    assert ctl.expected_acceptance > 0.8 and ctl.next_k() >= 4
    assert service_a.value == shared_before  # the controller reads the shared estimate; the engine writes it


def test_a_bad_draft_is_switched_off_for_concurrent_sessions_within_a_few_rounds() -> None:
    service_a, service_c = Estimate(0.5, 2.0), Estimate(0.2, 2.0)
    sessions = [
        AdaptiveDraftLength(
            k_max=4,
            acceptance=Estimate(0.5),
            cost_ratio=Estimate(0.2),
            service_acceptance=service_a,
            service_cost_ratio=service_c,
        )
        for _ in range(8)
    ]
    drafted_rounds = 0
    for _ in range(3):  # three batch steps of 8 sessions that all reject every draft token
        for ctl in sessions:
            k = ctl.next_k()
            if k:
                drafted_rounds += 1
                ctl.observe(k, 0, draft_ms=0.2 * k, verify_ms=1.0)
                service_a.update(0.0)
                service_c.update(0.2)
    assert all(ctl.next_k() == 0 for ctl in sessions)
    assert drafted_rounds <= 10  # the first step's rounds, about; not ten rounds per session


def test_sessions_sharing_a_probe_budget_take_turns_and_back_off() -> None:
    shared = ProbeBudget(16, max_every=64)
    bad = [
        AdaptiveDraftLength(k_max=4, acceptance=Estimate(0.0, 32), cost_ratio=Estimate(0.2, 32), probes=shared)
        for _ in range(8)
    ]
    steps = [sum(ctl.next_k() for ctl in bad) for _ in range(64)]  # 64 batch steps of 8 sessions: 512 rounds
    # probes after 16, 32 (48), 64 (112), then every 64 rounds of all sessions: not one per 16 rounds of each
    assert sum(steps) == 3 + (512 - 112) // 64
    good = AdaptiveDraftLength(k_max=4, acceptance=Estimate(0.9, 32), cost_ratio=Estimate(0.05, 32), probes=shared)
    assert good.next_k() > 0  # a session that pays resets the wait
    assert sum(bad[0].next_k() for _ in range(16)) == 1
    alone = AdaptiveDraftLength(k_max=4, acceptance=Estimate(0.0, 32), cost_ratio=Estimate(0.2, 32))
    assert [i for i in range(100) if alone.next_k()] == [15, 47]  # after 16, then 32 more rounds


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


def test_the_cost_fit_sees_decode_steps_not_prefills() -> None:
    """A prefill's per-token cost (a quarter of a decode token's on a CPU) must not set sigma."""
    rng = random.Random(1)
    estimates = ServiceEstimates()
    for _request in range(6):
        estimates.observe_target(100, 1, 34.0 + 1.1 * 100, max_decode_tokens=5)  # the prompt's prefill
        for _ in range(30):
            n = rng.choice([1, 1, 1, 2, 3])
            estimates.observe_target(n, 1, (30.0 + 4.5 * n) * rng.uniform(0.98, 1.02), max_decode_tokens=5)
    assert estimates.batch_share() == pytest.approx(4.5 / 34.5, rel=0.15)


def test_a_cheap_draft_that_is_rarely_right_is_switched_off_once_its_hop_is_measured() -> None:
    """Suffix-like: no compute, a 3 ms hop on a 35 ms verify, one draft token in four accepted."""
    rng = random.Random(2)
    estimates = ServiceEstimates()
    ctl = estimates.controller(k_max=4)
    ks = []
    for _ in range(400):
        share = estimates.batch_share()
        k = ctl.next_k(share)
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < 0.22:
            accepted += 1
        verify_ms = 30.0 + 4.5 * (k + 1)
        estimates.observe_target(k + 1, 1, verify_ms, max_decode_tokens=5)
        estimates.observe(ctl, k, accepted, 0.05 * k, verify_ms, draft_wall_ms=3.0 if k else 0.0)
    assert estimates.overhead.value == pytest.approx(3.0 / 39.0, rel=0.35)
    assert ks[-200:].count(0) >= 180  # target-only, but for the probes
