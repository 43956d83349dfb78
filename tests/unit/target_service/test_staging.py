"""Staged verifies at the target servicer (target_service/staging.py), on an emulated target, no gRPC.

A stage names candidates for the round after the one being verified; once that round's verdict
is known the servicer verifies the candidate it names by itself and answers the stage with that
verdict (staged_candidate = 1 + index), or answers staged_candidate 0 when none ran. The staged
verdict must be exactly the one a verify sent after the verdict would give.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from specd.core.model.sim import parse_sim_spec
from specd.core.rounds import steps
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.serving import wire
from specd.serving.streams import Stamped
from specd.v1 import common_pb2, target_pb2
from target_service.servicer import TargetServicer

SPEC = "sim:h100-tp2-70b,vocab_size=512,time_scale=0"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PARAMS = SamplingParams(temperature=0.0, seed=7)
SID = "s"


def _verifier() -> Verifier:
    return Verifier(parse_sim_spec(SPEC).runner("target"))


class Stream:
    """One stream into a servicer: submits messages as a stream message, collects the answers."""

    def __init__(self, servicer: TargetServicer) -> None:
        self.servicer = servicer
        self.answers: dict[int, target_pb2.TargetResponse] = {}
        self._arrived = threading.Condition()
        self._ids = iter(range(1, 10_000))

    def deliver(self, answered: list[tuple[Stamped[target_pb2.TargetRequest], Any]]) -> None:
        with self._arrived:
            for stamped, resp in answered:
                assert stamped.request.request_id not in self.answers, "answered twice"
                self.answers[stamped.request.request_id] = resp
            self._arrived.notify_all()

    def send(self, *requests: target_pb2.TargetRequest) -> list[int]:
        ids = []
        for req in requests:
            req.request_id = next(self._ids)
            ids.append(req.request_id)
        self.servicer._submit(
            [Stamped(r, time.perf_counter_ns(), deliver=self.deliver) for r in requests], self.deliver
        )
        return ids

    def answer(self, request_id: int, timeout: float = 10.0) -> target_pb2.TargetResponse:
        with self._arrived:
            assert self._arrived.wait_for(lambda: request_id in self.answers, timeout), f"no answer to {request_id}"
            return self.answers[request_id]


@pytest.fixture
def stream():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield Stream(TargetServicer(_verifier(), pool, common_pb2.ModelInfo()))


def _open() -> target_pb2.TargetRequest:
    return wire.open_request(target_pb2.TargetRequest, steps.OpenRequest(SID, PROMPT, PARAMS), {})


def _verify(committed: int, drafts: list[int]) -> target_pb2.TargetRequest:
    return wire.verify_request(steps.VerifyRequest(SID, committed, Proposal(drafts), start=committed), {})


def _reference(rounds: list[list[int]]) -> list[steps.VerifyOutcome]:
    """Verdicts of verifies sent one after another (the unstaged way) for these proposals."""
    v = _verifier()
    v.open(SID, PROMPT, PARAMS)
    out, committed = [], len(PROMPT)
    for drafts in rounds:
        o = v.verify(steps.VerifyRequest(SID, committed, Proposal(drafts), start=committed))
        out.append(o)
        committed = o.committed_length
    return out


def _stage(committed: int, candidates: list[tuple[int, int, list[int]]]) -> target_pb2.TargetRequest:
    staged = tuple(steps.StagedRound(j, t, Proposal(d)) for j, t, d in candidates)
    return wire.stage_request(steps.StageRequest(SID, committed, staged), {})


def _round_one() -> tuple[list[int], steps.VerifyOutcome]:
    drafts = [11, 12, 13]
    return drafts, _reference([drafts])[0]


@pytest.mark.parametrize("stage_first", [True, False], ids=["staged-before-its-verdict", "staged-after-it"])
def test_the_candidate_the_verdict_names_is_verified_by_the_target_itself(stream: Stream, stage_first: bool) -> None:
    drafts, first = _round_one()
    nxt = [21, 22]
    want = _reference([drafts, nxt])[1]
    wrong = (first.accepted, (first.token_id + 1) % 512, [31, 32])
    right = (first.accepted, first.token_id, nxt)
    stream.answer(stream.send(_open())[0])
    if stage_first:  # in one stream message: the verify, then the stage (the usual order on the wire)
        verify_id, stage_id = stream.send(_verify(len(PROMPT), drafts), _stage(len(PROMPT), [wrong, right]))
    else:
        (verify_id,) = stream.send(_verify(len(PROMPT), drafts))
        stream.answer(verify_id)
        (stage_id,) = stream.send(_stage(len(PROMPT), [wrong, right]))
    assert stream.answer(verify_id).verdict.accepted == first.accepted
    staged = stream.answer(stage_id)
    assert staged.staged_candidate == 2 and staged.WhichOneof("result") == "verdict"
    got = wire.verdict_from_proto(staged)
    assert (got.accepted, got.token_id, got.committed_length) == (want.accepted, want.token_id, want.committed_length)
    # the session goes on from the staged verdict: the next verify starts where it committed
    (after,) = stream.send(_verify(got.committed_length, [41]))
    assert stream.answer(after).WhichOneof("result") == "verdict"


def test_a_stage_whose_candidates_the_verdict_does_not_name_runs_none(stream: Stream) -> None:
    drafts, first = _round_one()
    stream.answer(stream.send(_open())[0])
    verify_id, stage_id = stream.send(
        _verify(len(PROMPT), drafts), _stage(len(PROMPT), [(first.accepted, (first.token_id + 1) % 512, [5])])
    )
    stream.answer(verify_id)
    none = stream.answer(stage_id)
    assert none.staged_candidate == 0 and none.WhichOneof("result") == "ack"
    # nothing ran: the session is where the verdict left it
    (nxt,) = stream.send(_verify(first.committed_length, [5]))
    assert stream.answer(nxt).WhichOneof("result") == "verdict"


def test_a_waiting_stage_is_answered_when_its_session_moves_on_another_way(stream: Stream) -> None:
    stream.answer(stream.send(_open())[0])
    # staged for a round that was never sent: a close comes first
    (stage_id,) = stream.send(_stage(len(PROMPT) + 5, [(0, 1, [2])]))
    (close_id,) = stream.send(wire.close_request(target_pb2.TargetRequest, steps.CloseRequest(SID)))
    assert stream.answer(close_id).WhichOneof("result") == "ack"
    assert stream.answer(stage_id).staged_candidate == 0


def test_a_stage_for_a_round_that_failed_runs_none(stream: Stream) -> None:
    stream.answer(stream.send(_open())[0])
    bad = _verify(len(PROMPT) + 3, [1])  # out of step: the verify fails
    verify_id, stage_id = stream.send(bad, _stage(len(PROMPT) + 3, [(0, 1, [2])]))
    assert stream.answer(verify_id).WhichOneof("result") == "error"
    assert stream.answer(stage_id).staged_candidate == 0


def test_a_stage_waits_for_the_verify_of_its_round_sent_before_it_not_an_older_verdict(stream: Stream) -> None:
    """The coordinator verified the round again (it did not use what the target had verified for it): a stage
    sent after that verify is decided on the new verdict, not on the one the target held before."""
    first_drafts, first = _round_one()
    again = [first.token_id, 7, 8]  # another proposal for the same round: its verdict differs from the first's
    want = _reference([again])[0]
    assert (want.accepted, want.token_id) != (first.accepted, first.token_id)
    nxt = [21, 22]
    expected = _reference([again, nxt])[1]
    stream.answer(stream.send(_open())[0])
    stream.answer(stream.send(_verify(len(PROMPT), first_drafts))[0])  # the verdict the target holds
    verify_id, stage_id = stream.send(
        _verify(len(PROMPT), again), _stage(len(PROMPT), [(want.accepted, want.token_id, nxt)])
    )
    assert stream.answer(verify_id).verdict.accepted == want.accepted
    staged = stream.answer(stage_id)
    assert staged.staged_candidate == 1
    got = wire.verdict_from_proto(staged)
    assert (got.accepted, got.token_id, got.committed_length) == (
        expected.accepted,
        expected.token_id,
        expected.committed_length,
    )


def test_a_deferred_verdict_runs_the_candidate_that_assumed_it_and_that_round_defers_too(stream: Stream) -> None:
    """Post-verify: the round defers its bonus, and every draft is accepted. Its pre-draft (staged with
    `deferred`: the drafts start at the bonus position) runs on that verdict, deferring its own bonus as
    the coordinator asked: exactly what the two verifies sent one after the other give."""
    v = _verifier()
    v.open(SID, PROMPT, PARAMS)
    greedy = []  # the target's own tokens: drafts it accepts at T = 0
    for _ in range(5):
        o = v.verify(steps.VerifyRequest(SID, len(PROMPT) + len(greedy), Proposal([])))
        greedy.append(o.token_id)
    drafts, nxt = greedy[:3], [greedy[3], greedy[4]]
    ref = _verifier()
    ref.open(SID, PROMPT, PARAMS)
    want = []
    committed = len(PROMPT)
    for d in (drafts, nxt):
        want.append(ref.verify(steps.VerifyRequest(SID, committed, Proposal(d), start=committed, defer_bonus=True)))
        committed = want[-1].committed_length
    assert want[0].deferred and want[1].deferred
    stream.answer(stream.send(_open())[0])
    first = wire.verify_request(
        steps.VerifyRequest(SID, len(PROMPT), Proposal(drafts), start=len(PROMPT), defer_bonus=True), {}
    )
    candidates = (
        steps.StagedRound(3, greedy[3], Proposal([5])),  # the same length with a bonus: not this verdict
        steps.StagedRound(3, -1, Proposal(nxt), deferred=True, defer_bonus=True),
    )
    verify_id, stage_id = stream.send(first, wire.stage_request(steps.StageRequest(SID, len(PROMPT), candidates), {}))
    assert stream.answer(verify_id).verdict.kind == target_pb2.TOKEN_KIND_DEFERRED
    staged = stream.answer(stage_id)
    assert staged.staged_candidate == 2
    got = wire.staged_outcome_from_proto(staged, steps.StageRequest(SID, len(PROMPT), candidates), 0.0, 0.0)
    assert got.outcome is not None and got.outcome.deferred
    assert (got.outcome.accepted, got.outcome.committed_length) == (want[1].accepted, want[1].committed_length)
