"""Staged verifies: the next round's verify, run as soon as the target's own verdict picks it.

A pipelined round's pre-drafts reach the coordinator while the target is still
verifying that round. The coordinator stages them here (a StageVerify message:
one candidate per verdict (accepted, token_id) a pre-draft assumes). When the
target's verdict on that round is known (it just ran, or it ran before the
stage arrived), the candidate it names is verified in the target's next pass,
without a round trip to the coordinator; the stage's one answer is that
verdict (staged_candidate = 1 + its index), or an ack with staged_candidate = 0
when no candidate ran. The coordinator still decides what it commits: a
staged verdict it does not use is rolled back by its next message's start.

Everything here runs on the model thread (the servicer's hold / after_batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specd.serving.streams import Stamped
from specd.v1 import target_pb2

Item = Stamped[target_pb2.TargetRequest]


@dataclass(frozen=True)
class _Verdict:
    """A session's last verdict: the round's committed length before it, and what it was."""

    committed_length: int
    accepted: int
    token_id: int  # -1: deferred (no token: nothing staged can follow it)


class StagedVerifies:
    """The stages waiting for their round's verdict, per session, and the last verdict of each session.

    resubmit(item): queue a message for the model thread (the batcher), answered through item.deliver.
    answer(item, response): hand a held message's answer to its stream now.
    none(item): the answer to a stage whose candidates did not run.
    """

    def __init__(
        self,
        resubmit: Callable[[Item], None],
        answer: Callable[[Item, target_pb2.TargetResponse], None],
        none: Callable[[target_pb2.TargetRequest], target_pb2.TargetResponse],
    ) -> None:
        self._resubmit = resubmit
        self._answer = answer
        self._none = none
        self._waiting: dict[str, Item] = {}  # session -> its stage, until its round's verdict
        self._verdicts: dict[str, _Verdict] = {}  # session -> its last verdict

    def hold(self, items: Sequence[Item]) -> set[int]:
        """Keep this batch's stages (by id); a session's other messages end its waiting stage first."""
        held: set[int] = set()
        for item in items:
            req = item.request
            sid = req.session_id
            op = req.WhichOneof("op")
            if op == "stage":
                self._drop(sid)  # a newer stage replaces it
                held.add(id(item))
                verdict = self._verdicts.get(sid)
                if verdict is not None and verdict.committed_length == req.committed_length:
                    self._decide(item, verdict)  # its round was verified before it came
                else:
                    self._waiting[sid] = item
            elif sid in self._waiting and not (
                op == "verify" and req.committed_length == self._waiting[sid].request.committed_length
            ):
                self._drop(sid)  # the session moved on another way (open, close, another round)
            if op in ("open", "close", "verify", "verify_tree"):
                # Its verdict is about to change: a stage later in this batch waits for the new one
                # (a verify again of a round the target staged itself replaces that staged verdict).
                self._verdicts.pop(sid, None)
        return held

    def after_batch(self, items: Sequence[Item], responses: Sequence[target_pb2.TargetResponse]) -> None:
        """Note each verify's verdict; a stage waiting for it is decided; a staged candidate's answer is marked."""
        for item, resp in zip(items, responses):
            req = item.request
            if req.WhichOneof("op") != "verify":
                continue
            if item.staged_candidate:
                resp.staged_candidate = item.staged_candidate
            sid = req.session_id
            if resp.WhichOneof("result") != "verdict":
                self._verdicts.pop(sid, None)
                self._drop(sid)  # its round failed: nothing staged can follow it
                continue
            v = resp.verdict
            deferred = v.kind == target_pb2.TOKEN_KIND_DEFERRED
            verdict = _Verdict(req.committed_length, v.accepted, -1 if deferred else v.token_id)
            self._verdicts[sid] = verdict
            waiting = self._waiting.get(sid)
            if waiting is not None and waiting.request.committed_length == verdict.committed_length:
                del self._waiting[sid]
                self._decide(waiting, verdict)

    def _decide(self, stage: Item, verdict: _Verdict) -> None:
        """Run the candidate this verdict names (as the stage's answer), or answer that none ran."""
        req = stage.request
        for i, c in enumerate(req.stage.candidates):
            if c.accepted != verdict.accepted or c.deferred != (verdict.token_id < 0):
                continue
            if c.deferred or c.token_id == verdict.token_id:
                committed = req.committed_length + c.accepted + (0 if c.deferred else 1)
                run = target_pb2.TargetRequest(
                    request_id=req.request_id,
                    session_id=req.session_id,
                    committed_length=committed,
                    trace_context=req.trace_context,
                )
                run.verify.start = committed  # the target committed its own verdict: nothing to patch
                run.verify.draft_token_ids.extend(c.draft_token_ids)
                run.verify.q.extend(c.q)
                run.verify.defer_bonus = c.defer_bonus
                self._resubmit(Stamped(run, time.perf_counter_ns(), deliver=stage.deliver, staged_candidate=i + 1))
                return
        self._answer(stage, self._none(req))

    def _drop(self, sid: str) -> None:
        stage = self._waiting.pop(sid, None)
        if stage is not None:
            self._answer(stage, self._none(stage.request))
