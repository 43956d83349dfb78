"""Scripted ports for the round loop's tests: a greedy target and a draft that is right most of the time.

Both are pure functions of the prefix, so the right output is known (the
target's greedy chain) whatever the loop does, and every proposal the target
receives can be checked against what the draft says for the committed prefix:
a draft made for any other prefix shows up in `FakeTarget.violations`.
Failures, hangs, lost sessions and latencies are scripted per call number
(1-based).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specd.core.draft.branching import select_branches, top_ranking
from specd.core.errors import DeadlineExceeded, SessionNotFound, SessionOutOfSync, SpecdError, Unavailable
from specd.core.phases import PhaseLog
from specd.core.rounds import steps
from specd.core.rounds.ports import Carrier
from specd.core.rounds.record import RoundRecord
from specd.core.rounds.staging import StagedVerdicts
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.tree import DraftTree

V = 61  # vocabulary size


def target_next(prefix: Sequence[int]) -> int:
    """The target's greedy token after `prefix`."""
    a, b = prefix[-1], prefix[-2] if len(prefix) > 1 else 0
    return (a * 7 + b * 3 + len(prefix)) % V


def agree_mostly(prefix: Sequence[int]) -> bool:
    return (prefix[-1] + len(prefix)) % 4 != 0  # ~3 in 4


def draft_next(prefix: Sequence[int], agrees: Callable[[Sequence[int]], bool] = agree_mostly) -> int:
    t = target_next(prefix)
    return t if agrees(prefix) else (t + 1) % V


def alternative(prefix: Sequence[int], drafted: int) -> int:
    """The fake draft's second choice after `prefix`: the target's token when it drafted another, mostly."""
    t = target_next(prefix)
    return t if t != drafted and prefix[-1] % 3 != 0 else (t + 5) % V


def draft_distribution(prefix: Sequence[int], step: Callable[[Sequence[int]], int]) -> torch.Tensor:
    """[V] what the fake draft believes after `prefix`: its token 0.7, its alternative 0.2, another 0.1."""
    d = step(prefix)
    probs = torch.zeros(V)
    probs[(d + 3) % V] += 0.1
    probs[alternative(prefix, d)] += 0.2
    probs[d] += 0.7
    return probs


def fake_tree(prefix: Sequence[int], budget: int, depth: int, step: Callable[[Sequence[int]], int]) -> DraftTree:
    """The fake draft's tree: its chain (node 2j at depth j + 1), each node with its alternative as a sibling
    (node 2j + 1) while the budget allows; the chain is kept to its depth first. One-hot q."""
    tokens: list[int] = []
    parents: list[int] = []
    seq, parent = list(prefix), -1
    spare = max(0, budget - depth)  # nodes left for siblings once the chain is whole
    for _ in range(min(depth, budget)):
        d = step(seq)
        tokens.append(d)
        parents.append(parent)
        parent = len(tokens) - 1
        if spare > 0:
            tokens.append(alternative(seq, d))
            parents.append(parents[parent])
            spare -= 1
        seq.append(d)
    return DraftTree(tuple(tokens), tuple(parents))


def chain(prefix: Sequence[int], n: int, step: Callable[[Sequence[int]], int]) -> list[int]:
    seq = list(prefix)
    for _ in range(n):
        seq.append(step(seq))
    return seq[len(prefix) :]


@dataclass
class Script:
    """What happens at call n (1-based) of a port."""

    latency_s: float = 0.001
    # The compute the ports report, whatever the short sleep above: a draft token takes
    # compute_ms, a verify 20 times that (a cheap draft, as on the hardware speculation is for).
    compute_ms: float = 1.0
    fail: dict[int, SpecdError] = field(default_factory=dict)  # raise this at call n
    hang: set[int] = field(default_factory=set)  # never answer call n (the transport times out)
    forget: set[int] = field(default_factory=set)  # lose the session just before call n
    slow: dict[int, float] = field(default_factory=dict)  # extra latency at call n

    async def before(self, n: int, timeout: float, sessions: dict[str, list[int]], sid: str) -> None:
        await asyncio.sleep(self.latency_s + self.slow.get(n, 0.0))
        if n in self.hang:
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"no answer within {timeout:.2f} s")
        if n in self.fail:
            raise self.fail[n]
        if n in self.forget:
            sessions.pop(sid, None)


class FakeTarget:
    """A TargetPort with the greedy target_next; checks each proposal against the draft for its prefix."""

    def __init__(self, script: Script | None = None, draft: Callable[[Sequence[int]], int] | None = draft_next) -> None:
        self.script = script or Script()
        self.draft = draft  # what a correct proposal is made of (None: do not check)
        self.sessions: dict[str, list[int]] = {}
        self.calls = 0
        self.opens = 0
        self.closed: list[str] = []
        self.close_delay_s = 0.0  # how long a close takes to be answered
        self.carriers: list[Carrier] = []
        self.violations: list[tuple[list[int], list[int]]] = []  # (committed prefix, proposal) drafted elsewhere
        self.trees: list[tuple[list[int], DraftTree]] = []  # (committed prefix, tree) of every tree verify
        self.staging = StagedVerdicts()
        self.stages: list[steps.StageRequest] = []  # every stage sent
        self.staged_runs = 0  # staged candidates it verified

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        self.opens += 1
        self.staging.forget(request.session_id)
        self.sessions[request.session_id] = list(request.token_ids)

    async def stage(self, request: steps.StageRequest, *, timeout: float, carrier: Carrier) -> steps.StagedOutcome:
        self.stages.append(request)
        result = await self.staging.stage(request, lambda v: self.verify(v, timeout=timeout, carrier=carrier))
        self.staged_runs += result.outcome is not None
        return result

    async def verify(self, request: steps.VerifyRequest, *, timeout: float, carrier: Carrier) -> steps.VerifyOutcome:
        return await self.staging.verified(request, self._verify(request, carrier, timeout))

    async def _verify(
        self, request: steps.VerifyRequest, carrier: Carrier, timeout: float = 30.0
    ) -> steps.VerifyOutcome:
        session_id, committed_length, proposal = request.session_id, request.committed_length, request.proposal
        self.calls += 1
        self.carriers.append(carrier)
        await self.script.before(self.calls, timeout, self.sessions, session_id)
        if session_id not in self.sessions:
            raise SessionNotFound(f"no session {session_id}")
        held = self.sessions[session_id]
        if len(held) < committed_length:
            raise SessionOutOfSync("behind")
        prefix = held[:committed_length]  # roll back a verdict the caller did not see
        drafts = list(proposal.token_ids)
        if self.draft is not None and drafts != chain(prefix, len(drafts), self.draft):
            self.violations.append((prefix, drafts))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target_next(prefix + drafts[:accepted]):
            accepted += 1
        committed = prefix + drafts[:accepted]
        deferred = request.defer_bonus and 0 < len(drafts) == accepted
        token = -1 if deferred else target_next(committed)
        self.sessions[session_id] = committed + ([] if deferred else [token])
        return steps.VerifyOutcome(
            accepted=accepted,
            token_id=token,
            is_bonus=accepted == len(drafts) and not deferred,
            committed_length=len(self.sessions[session_id]),
            compute_ms=20.0 * self.script.compute_ms,
            phases=PhaseLog(batch_size=1, batch_tokens=len(drafts) + 1),
            deferred=deferred,
        )

    async def verify_tree(
        self, request: steps.TreeVerifyRequest, *, timeout: float, carrier: Carrier
    ) -> steps.TreeVerifyOutcome:
        """Greedy over the tree: descend to the child that is the target's token, then emit its next token."""
        self.calls += 1
        self.carriers.append(carrier)
        await self.script.before(self.calls, timeout, self.sessions, request.session_id)
        if request.session_id not in self.sessions:
            raise SessionNotFound(f"no session {request.session_id}")
        held, tree = self.sessions[request.session_id], request.tree
        if len(held) < request.committed_length:
            raise SessionOutOfSync("behind")
        prefix = held[: request.committed_length]
        self.trees.append((prefix, tree))
        path: list[int] = []
        while True:
            want = target_next(prefix + [tree.token_ids[i] for i in path])
            kids = [c for c in tree.children[(path[-1] + 1) if path else 0] if tree.token_ids[c] == want]
            if not kids:
                break
            path.append(kids[0])
        tokens = tuple(tree.token_ids[i] for i in path)
        token = target_next(prefix + list(tokens))
        self.sessions[request.session_id] = prefix + list(tokens) + [token]
        return steps.TreeVerifyOutcome(
            path=tuple(path),
            tokens=tokens,
            token_id=token,
            is_bonus=not tree.children[(path[-1] + 1) if path else 0],
            committed_length=len(self.sessions[request.session_id]),
            compute_ms=20.0 * self.script.compute_ms,
            phases=PhaseLog(batch_size=1, batch_tokens=len(tree) + 1),
        )

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None:
        await asyncio.sleep(self.close_delay_s)  # a peer still busy with the session's last batch
        self.closed.append(request.session_id)
        self.staging.forget(request.session_id)
        self.sessions.pop(request.session_id, None)


class FakeDraft:
    """A DraftPort drafting with `step`; `lie` makes call n send one token more than asked.

    Branch calls choose with the real rule (specd.core.draft.branching) over draft_distribution."""

    def __init__(
        self,
        script: Script | None = None,
        step: Callable[[Sequence[int]], int] = draft_next,
        *,
        lie: set[int] | None = None,
        short: set[int] | None = None,
        confidence: Sequence[float] = (),
    ) -> None:
        self.script = script or Script()
        self.confidence = tuple(confidence)  # per draft position (repeating): what proposals say of themselves
        self.step = step
        self.lie = lie or set()
        self.short = short or set()  # call n proposes one token fewer than asked
        self.up = True
        self.sessions: dict[str, list[int]] = {}
        self.calls = 0
        self.opens = 0
        self.closed: list[str] = []
        self.final: dict[str, list[int]] = {}  # the committed tokens each close carried
        self.prefixes: list[list[int]] = []  # the prefix of every propose, in order
        self.branch_calls: list[tuple[list[int], int]] = []  # (prefix, pending) of every branch call
        self.guess_flags: list[bool] = []  # per propose call: whether its first token guesses the bonus
        self.branch_results: list[steps.Branches] = []  # what every branch call that answered returned
        self.shared: dict[str, int] = {}  # session -> tokens its branches share (after a branch call)
        self.violations: list[tuple[str, int]] = []  # (session, start) of calls that started past them

    async def available(self) -> bool:
        return self.up

    async def open(self, request: steps.OpenRequest, *, timeout: float, carrier: Carrier) -> None:
        self.opens += 1
        self.sessions[request.session_id] = list(request.token_ids)
        self.shared.pop(request.session_id, None)

    async def propose(self, request: steps.ProposeRequest, *, timeout: float, carrier: Carrier) -> Proposal:
        n, prefix = await self._step(request, timeout)
        self.prefixes.append(prefix)
        self.guess_flags.append(request.guess_bonus)
        drafts = chain(prefix, self._length(n, request.num_tokens), self.step)
        self.sessions[request.session_id] = prefix + drafts
        return Proposal(drafts, compute_ms=self.script.compute_ms * max(1, len(drafts)), confidence=self._conf(drafts))

    def _conf(self, drafts: Sequence[int]) -> tuple[float, ...]:
        """What the proposal says of itself: the scripted confidences, repeating (none if unscripted)."""
        return tuple(self.confidence[i % len(self.confidence)] for i in range(len(drafts))) if self.confidence else ()

    async def propose_branches(
        self, request: steps.BranchRequest, *, timeout: float, carrier: Carrier
    ) -> steps.Branches:
        """The real branch rule over the fake's beliefs (draft_distribution); one call, like a batched pass."""
        session_id, pending, budget = request.session_id, request.pending, request.budget
        n, prefix = await self._step(request, timeout)
        self.branch_calls.append((prefix, pending))
        base = len(prefix) - pending
        probs = torch.stack([draft_distribution(prefix[: base + j], self.step) for j in range(pending + 1)])
        k = self._length(n, request.num_tokens)
        branches = []
        ranking = top_ranking(probs, prefix[base:], budget + 1)
        for c in select_branches(ranking, prefix[base:], request.acceptance, budget):
            drafts = chain([*prefix[: base + c.accepted], c.token_id], k, self.step)
            proposal = Proposal(drafts, compute_ms=self.script.compute_ms, confidence=self._conf(drafts))
            branches.append(steps.Branch(c.accepted, c.token_id, proposal))
        self.sessions[session_id] = prefix
        self.shared[session_id] = base  # what every branch shares with the sequence
        result = steps.Branches(tuple(branches), compute_ms=self.script.compute_ms)
        self.branch_results.append(result)
        return result

    async def propose_tree(self, request: steps.TreeProposeRequest, *, timeout: float, carrier: Carrier) -> DraftTree:
        """fake_tree after the prefix; the sequence stays the prefix (a tree's nodes do not join it)."""
        n, prefix = await self._step(request, timeout)
        self.prefixes.append(prefix)
        self.sessions[request.session_id] = prefix
        more = 1 if n in self.lie else 0  # a lie: one node and one level more than asked
        return fake_tree(prefix, request.budget + more, request.depth + more, self.step)

    async def _step(
        self, request: steps.ProposeRequest | steps.BranchRequest | steps.TreeProposeRequest, timeout: float
    ) -> tuple[int, list[int]]:
        """Count the call, play the script, and bring the session to the request's prefix: (call n, prefix)."""
        self.calls += 1
        n = self.calls
        await self.script.before(n, timeout, self.sessions, request.session_id)
        if request.session_id not in self.sessions:
            raise SessionNotFound(f"no session {request.session_id}")
        return n, self._sync(request)

    def _length(self, n: int, num_tokens: int) -> int:
        """Drafts call n sends: num_tokens, one more if it lies, one fewer if it runs short."""
        return max(0, num_tokens + (1 if n in self.lie else 0) - (1 if n in self.short else 0))

    def _sync(self, request: steps.ProposeRequest | steps.BranchRequest | steps.TreeProposeRequest) -> list[int]:
        """The prefix from (start, tail); a start past what the branches share is a protocol violation."""
        session_id, start = request.session_id, request.start
        if start > self.shared.pop(session_id, math.inf):
            self.violations.append((session_id, start))
        return steps.sync_prefix(self.sessions[session_id], request.committed_length, start, request.tail)

    async def close(self, request: steps.CloseRequest, *, timeout: float) -> None:
        session_id = request.session_id
        self.closed.append(session_id)
        self.final[session_id] = list(request.committed)
        self.sessions.pop(session_id, None)
        self.shared.pop(session_id, None)


class Watch:
    """A RoundObserver that keeps everything it is told."""

    def __init__(self) -> None:
        self.started: list[tuple[int, int]] = []
        self.events: list[tuple[str, str]] = []
        self.records: list[RoundRecord] = []
        self.failed: list[BaseException] = []

    def round_started(self, index: int, committed_length: int) -> Carrier:
        self.started.append((index, committed_length))
        return {"round": str(index)}

    def round_event(self, message: str, error: BaseException) -> None:
        self.events.append((message, type(error).__name__))

    def round_ended(self, record: RoundRecord) -> None:
        self.records.append(record)

    def round_failed(self, error: BaseException) -> None:
        self.failed.append(error)


def fail(n: int, error: SpecdError | None = None) -> dict[int, SpecdError]:
    return {n: error or Unavailable(f"scripted failure at call {n}")}
