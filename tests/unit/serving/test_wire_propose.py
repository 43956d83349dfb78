"""A propose call's fields cross the wire as sent, the bonus-match guess flag among them."""

from __future__ import annotations

import pytest

from specd.core.rounds import steps
from specd.serving import wire


@pytest.mark.parametrize("guess_bonus", [False, True])
def test_a_propose_request_round_trips(guess_bonus: bool) -> None:
    sent = steps.ProposeRequest("s", 12, 9, [4, 5, 6], 3, guess_bonus)
    got = wire.propose_request_from_proto(wire.propose_request(sent, {"traceparent": "x"}))
    assert got == sent
