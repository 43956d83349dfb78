"""How much requests' acceptance differs, and the weight a request's own verdicts get from it."""

from __future__ import annotations

import random

import pytest

from specd.core.rounds.auto import OFF, AutoPolicy
from specd.core.rounds.request_spread import RequestSpread

pytestmark = pytest.mark.unit


def requests(spread: RequestSpread, rates: list[float], verdicts: int, rng: random.Random) -> None:
    for rate in rates:
        spread.observe(verdicts, sum(rng.random() < rate for _ in range(verdicts)))


def test_alike_requests_lean_on_the_service() -> None:
    """Requests that differ by their coin noise alone: the service's rate counts for the most allowed."""
    for seed in range(5):
        spread = RequestSpread()
        requests(spread, [0.75] * 40, 20, random.Random(seed))
        assert spread.weight() >= 20.0, seed


def test_requests_that_differ_keep_their_own_rates() -> None:
    """A suffix drafter's requests: repetitive text accepted at 0.95, fresh text at 0.3."""
    for seed in range(5):
        spread = RequestSpread()
        requests(spread, [0.95, 0.3] * 20, 20, random.Random(seed))
        assert spread.weight() <= 2.0, seed


def test_the_default_holds_until_a_few_requests_finished() -> None:
    spread = RequestSpread(default=4.0)
    assert spread.weight() == 4.0
    spread.observe(20, 15)
    spread.observe(20, 15)
    assert spread.weight() == 4.0
    spread.observe(20, 15)
    assert spread.weight() == spread.largest  # three alike requests: no spread beyond the noise
    spread.observe(0, 0)  # a request that never drafted says nothing
    assert spread.weight() == spread.largest


def test_a_finished_request_feeds_its_class_and_unlucky_verdicts_move_an_alike_request_less() -> None:
    """Through the chooser: after many alike requests at 0.75, a new request's three rejections in four
    verdicts leave it near the service's rate; with the default weight they halve it."""
    policy = AutoPolicy()
    cls = policy.workload(greedy=False, running=1)
    rng = random.Random(1)

    def unlucky_request_rate() -> float:
        chooser = policy.chooser(4, (OFF,), target_only=True)
        for accepted in (0, 0, 0, 2):
            chooser.observe_verdict(cls, 2, accepted)
        return chooser.rates(cls)[0]

    before = unlucky_request_rate()
    for _ in range(30):
        chooser = policy.chooser(4, (OFF,), target_only=True)
        for _ in range(10):
            accepted = 0
            while accepted < 2 and rng.random() < 0.75:
                accepted += 1
            chooser.observe_verdict(cls, 2, accepted)
        chooser.finish()
    assert cls.spread.weight() >= 20.0
    after = unlucky_request_rate()
    service = cls.acceptance.rates(1, 0.5, 2.0)[0]
    assert before < service - 0.15  # the default weight: four verdicts move it a lot
    assert abs(after - service) < 0.05
