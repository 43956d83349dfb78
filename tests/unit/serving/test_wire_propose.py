"""A propose call's fields cross the wire as sent, the bonus-match guess flag among them; an open says
whether the caller reads the draft tokens' confidence, and the draft service opens the session so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from draft_service.servicer import DraftServicer
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds import steps
from specd.core.sampling.sampler import SamplingParams
from specd.serving import wire
from specd.v1 import common_pb2, draft_pb2, target_pb2


@pytest.mark.parametrize("guess_bonus", [False, True])
def test_a_propose_request_round_trips(guess_bonus: bool) -> None:
    sent = steps.ProposeRequest("s", 12, 9, [4, 5, 6], 3, guess_bonus)
    got = wire.propose_request_from_proto(wire.propose_request(sent, {"traceparent": "x"}))
    assert got == sent


@pytest.mark.parametrize("confidence", [True, False])
def test_an_open_says_whether_the_draft_sends_confidence(confidence: bool) -> None:
    params = SamplingParams(temperature=0.0, seed=1)
    sent = steps.OpenRequest("s", [5, 6, 7], params, "tenant", confidence)
    req = wire.open_request(draft_pb2.DraftRequest, sent, {})
    assert req.open.without_confidence is not confidence
    target = wire.open_request(target_pb2.TargetRequest, sent, {})  # a target drafts nothing: no such field set
    assert list(target.open.token_ids) == [5, 6, 7] and target.open.HasField("sampling")
    drafter = ModelDrafter(parse_sim_spec("sim:h100-8b,vocab_size=512,time_scale=0").runner("draft"))
    with ThreadPoolExecutor(max_workers=1) as pool:
        DraftServicer(drafter, pool, common_pb2.ModelInfo(), max_draft_tokens=8).open_session(req)
    proposal = drafter.propose(steps.ProposeRequest("s", 3, 3, [], 2))
    assert len(proposal) == 2 and len(proposal.confidence) == (2 if confidence else 0)
