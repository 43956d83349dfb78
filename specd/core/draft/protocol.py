"""The drafter protocol: what the draft service and the in-process loop need from a drafter.

And running one step's proposes and branch calls as one batch (`draft_work`).
The drafters: n-gram (specd.core.draft.ngram), suffix, hybrid and the model
drafter (specd.core.draft.model_drafter). The step messages they answer are
specd.core.rounds.steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from specd.core.draft.branching import bonus_guess
from specd.core.rounds.steps import BranchRequest, DraftResult, DraftWork, ProposeRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams


class Drafter(Protocol):
    """What the draft service and the in-process loop need from a drafter."""

    kind: str
    vocab_size: int

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = "",
        confidence: bool = True,
    ) -> None:
        """Open (or re-open) a session. tenant: whose learned state it may draft from and teach
        (specd.core.draft.tenant_index); a drafter that learns nothing across sessions ignores it.
        confidence False: the caller reads no Proposal.confidence, so a drafter for which it costs
        something (the model drafter's softmax per greedy row) may leave it out."""
        ...

    def propose(self, request: ProposeRequest) -> Proposal: ...

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]: ...

    def close(self, session_id: str) -> None: ...

    def active_sessions(self) -> int: ...


@runtime_checkable
class BranchingDrafter(Protocol):
    """A drafter that drafts proposes and branch calls of many sessions in one batched pass per step."""

    def draft_batch(self, requests: Sequence[DraftWork]) -> list[DraftResult | Exception]: ...


def draft_work(drafter: Drafter, requests: Sequence[DraftWork]) -> list[DraftResult | Exception]:
    """Proposes and branch calls of different sessions, as one batch where the drafter can.

    A drafter without a distribution of its own (n-gram, suffix, hybrid)
    answers a branch call with the all-accepted verdict only: it drafts one
    token more after the whole prefix, the first being its guess of the bonus
    (specd.core.draft.branching.bonus_guess). Its sequence then runs past the prefix;
    the next call's (start, tail) rolls it back as for any propose.
    """
    if isinstance(drafter, BranchingDrafter) and any(isinstance(r, BranchRequest) for r in requests):
        return drafter.draft_batch(requests)
    calls = [
        r
        if isinstance(r, ProposeRequest)
        else ProposeRequest(r.session_id, r.committed_length, r.start, r.tail, r.num_tokens + 1)
        for r in requests
    ]
    out: list[DraftResult | Exception] = []
    for r, result in zip(requests, drafter.propose_batch(calls)):
        if isinstance(r, BranchRequest) and not isinstance(result, Exception):
            out.append(bonus_guess(r.pending, result))
        else:
            out.append(result)
    return out


def propose_one(drafter: Drafter, request: ProposeRequest) -> Proposal:
    """propose() as a batch of one: the proposal, or the request's exception raised."""
    result = drafter.propose_batch([request])[0]
    if isinstance(result, BaseException):
        raise result
    return result


def propose_each(
    propose: Callable[[ProposeRequest], Proposal], requests: Sequence[ProposeRequest]
) -> list[Proposal | Exception]:
    """propose_batch of a drafter with no model to share: each request on its own, its error in its slot."""
    out: list[Proposal | Exception] = []
    for r in requests:
        try:
            out.append(propose(r))
        except Exception as exc:  # noqa: BLE001 - this request's error, reported in its slot
            out.append(exc)
    return out
