"""One request's session on each port: opened on first use, re-opened when lost, retried within budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from specd.core.errors import DeadlineExceeded, SessionNotFound, SessionOutOfSync, Unavailable
from specd.core.rounds import steps
from specd.core.rounds.ports import Carrier, DraftPort, TargetPort
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree

T = TypeVar("T")


class DraftSession:
    """What the draft holds for one request, as far as the loop knows.

    The draft's sequence is committed[:base] + ext: the first `base` committed
    tokens as of the last call, then what followed them there (an assumed
    extension and the drafts). Committed prefixes only grow, so the draft
    agrees with a later prefix on base + the common prefix of ext and the
    rest; that is where the next propose rolls it back to (`start`). After a
    branch call the draft holds several sequences (the prefix and its
    branches) that share committed[:base] only: ext is empty, so the next call
    starts within the committed prefix and the draft picks the sequence that
    continues.

    Calls run one at a time, in call order: each needs the sequence the one
    before left. A failed or cancelled call forgets the sequence (the draft
    may or may not have applied it), and the next call re-opens the session.
    """

    def __init__(
        self, port: DraftPort, session_id: str, params: SamplingParams, tenant: str = "", *, confidence: bool = True
    ) -> None:
        self.port = port
        self.session_id = session_id
        self.confidence = confidence  # the loop reads its proposals' confidence (auto); sent with every open
        self.params = params
        self.tenant = tenant  # sent with every open: the draft's learned state is the tenant's
        self.opened = False
        self.touched = False  # something was sent: close the session at the end
        self._base = 0
        self._ext: list[int] = []
        self._lock = asyncio.Lock()

    def agreement(self, prefix: Sequence[int]) -> int:
        """Leading tokens of `prefix` (committed + an extension) the draft's sequence holds."""
        n = min(self._base, len(prefix))
        for held, want in zip(self._ext, prefix[n:]):
            if held != want:
                break
            n += 1
        return n

    async def propose(
        self,
        committed: Sequence[int],
        extension: Sequence[int],
        num_tokens: int,
        *,
        timeout: float,
        carrier: Carrier,
        guess_bonus: bool = False,
    ) -> Proposal:
        """Up to num_tokens draft tokens after committed + extension; raises the port's SpecdError on failure.
        guess_bonus: the first is a guess of the target's bonus there (steps.ProposeRequest)."""

        async def send(start: int, prefix: list[int]) -> tuple[Proposal, list[int]]:
            request = steps.ProposeRequest(self.session_id, len(prefix), start, prefix[start:], num_tokens, guess_bonus)
            proposal = await self.port.propose(request, timeout=timeout, carrier=carrier)
            if len(proposal) > num_tokens:
                raise Unavailable(f"draft sent {len(proposal)} tokens for {num_tokens} asked")
            return proposal, [*extension, *proposal.token_ids]

        return await self._call(committed, extension, send, timeout=timeout, carrier=carrier)

    async def propose_branches(
        self,
        committed: Sequence[int],
        pending: Sequence[int],
        num_tokens: int,
        *,
        budget: int,
        acceptance: Sequence[float],
        timeout: float,
        carrier: Carrier,
    ) -> steps.Branches:
        """Branches for the verdicts of `pending` (being verified after `committed`), num_tokens drafts each.

        Afterwards the draft holds several sequences that share `committed` and
        nothing more for sure, so the next call starts within `committed`; the
        draft continues the sequence that holds most of that call's prefix.
        """

        async def send(start: int, prefix: list[int]) -> tuple[steps.Branches, list[int]]:
            request = steps.BranchRequest(
                self.session_id, len(prefix), start, prefix[start:], len(pending), num_tokens, budget, tuple(acceptance)
            )
            branches = await self.port.propose_branches(request, timeout=timeout, carrier=carrier)
            _check_branches(branches, len(pending), num_tokens, budget)
            return branches, []

        return await self._call(committed, pending, send, timeout=timeout, carrier=carrier)

    async def propose_tree(
        self,
        committed: Sequence[int],
        budget: int,
        depth: int,
        *,
        timeout: float,
        carrier: Carrier,
        extension: Sequence[int] = (),
    ) -> DraftTree:
        """A tree of at most `budget` nodes, `depth` levels after committed + extension (a pipelined tree's
        assumed path); the draft then holds committed + extension (a tree's nodes do not join it)."""

        async def send(start: int, prefix: list[int]) -> tuple[DraftTree, list[int]]:
            request = steps.TreeProposeRequest(self.session_id, len(prefix), start, prefix[start:], budget, depth)
            tree = await self.port.propose_tree(request, timeout=timeout, carrier=carrier)
            if len(tree) > budget or tree.depth > depth:
                raise Unavailable(f"draft sent a tree of {len(tree)} nodes, {tree.depth} deep, for {budget}, {depth}")
            return tree, list(extension)

        return await self._call(committed, extension, send, timeout=timeout, carrier=carrier)

    async def _call(
        self,
        committed: Sequence[int],
        extension: Sequence[int],
        send: Callable[[int, list[int]], Awaitable[tuple[T, list[int]]]],
        *,
        timeout: float,
        carrier: Carrier,
    ) -> T:
        """send(start, prefix) for prefix = committed + extension, opening the session first if needed.

        send returns its result and what the draft then holds after `committed`."""
        async with self._lock:
            prefix = [*committed, *extension]
            self.touched = True
            try:
                for _ in range(2):  # a second try after re-opening a session the draft lost
                    try:
                        if not self.opened:
                            request = steps.OpenRequest(
                                self.session_id, prefix, self.params, self.tenant, self.confidence
                            )
                            await self.port.open(request, timeout=timeout, carrier=carrier)
                            self.opened, self._base, self._ext = True, len(committed), list(extension)
                        result, held = await send(self.agreement(prefix), prefix)
                        self._base, self._ext = len(committed), held
                        return result
                    except (SessionNotFound, SessionOutOfSync):
                        self.opened = False
                raise Unavailable("draft lost the session twice in a row")
            except BaseException:
                self.opened = False
                raise

    async def close(self, timeout: float, committed: Sequence[int] = ()) -> None:
        if self.touched:
            start = self.agreement(committed) if self.opened else 0
            await self.port.close(steps.CloseRequest(self.session_id, committed, start), timeout=timeout)


def _check_branches(branches: steps.Branches, pending: int, num_tokens: int, budget: int) -> None:
    """Branches that cannot belong to this call mean a draft out of step: Unavailable (the round goes on)."""
    if len(branches) > budget:
        raise Unavailable(f"draft sent {len(branches)} branches for {budget} asked")
    for b in branches.branches:
        if not 0 <= b.accepted <= pending:
            raise Unavailable(f"draft sent a branch with {b.accepted} of {pending} pending tokens accepted")
        if len(b.proposal) > num_tokens:
            raise Unavailable(f"draft sent a branch of {len(b.proposal)} tokens for {num_tokens} asked")


class TargetSession:
    """The request's session on the target, and the retry budget of its verifies.

    A broken or slow target is retried (re-opening the session, with backoff)
    until `timeout_s` has passed since the first failure, or the deadline;
    then the round fails with Unavailable. A lost session is re-opened.
    """

    def __init__(self, port: TargetPort, session_id: str, params: SamplingParams, timeout_s: float) -> None:
        self.port = port
        self.session_id = session_id
        self.params = params
        self.timeout_s = timeout_s
        self.opened = False
        self.touched = False

    async def verify(
        self,
        committed: Sequence[int],
        proposal: Proposal,
        *,
        defer_bonus: bool,
        deadline: float,
        carrier: Carrier,
        on_retry: Callable[[BaseException], None],
    ) -> steps.VerifyOutcome:
        async def send(timeout: float) -> steps.VerifyOutcome:
            # start = the committed length: the target rolls back any verdict the loop never saw.
            request = steps.VerifyRequest(
                self.session_id, len(committed), proposal, start=len(committed), defer_bonus=defer_bonus
            )
            outcome = await self.port.verify(request, timeout=timeout, carrier=carrier)
            _check(outcome, proposal, defer_bonus)
            return outcome

        return await self._retrying(committed, send, deadline=deadline, carrier=carrier, on_retry=on_retry)

    async def stage(
        self,
        committed_length: int,
        candidates: Sequence[steps.StagedRound],
        *,
        deadline: float,
        carrier: Carrier,
    ) -> steps.StagedOutcome:
        """Stage the next round's verify while this round (after committed_length tokens) is verified.

        No retries: a stage that fails is one that ran nothing (the loop verifies as usual),
        and one sent to a session the target may not hold ran nothing either."""
        timeout = min(self.timeout_s, deadline - time.monotonic())
        if not self.opened or timeout <= 0:
            return steps.StagedOutcome.NONE
        request = steps.StageRequest(self.session_id, committed_length, tuple(candidates))
        result = await self.port.stage(request, timeout=timeout, carrier=carrier)
        if result.outcome is not None:
            chosen = candidates[result.candidate]
            _check(result.outcome, chosen.proposal, chosen.defer_bonus)
        return result

    async def verify_tree(
        self,
        committed: Sequence[int],
        tree: DraftTree,
        *,
        deadline: float,
        carrier: Carrier,
        on_retry: Callable[[BaseException], None],
    ) -> steps.TreeVerifyOutcome:
        """The verdict on `tree` after `committed`, retried as verify's."""

        async def send(timeout: float) -> steps.TreeVerifyOutcome:
            request = steps.TreeVerifyRequest(self.session_id, len(committed), tree, start=len(committed))
            outcome = await self.port.verify_tree(request, timeout=timeout, carrier=carrier)
            if not tree.is_path(outcome.path) or outcome.tokens != tuple(tree.token_ids[i] for i in outcome.path):
                raise Unavailable(f"the target accepted nodes {list(outcome.path)}, not a path of the tree it was sent")
            return outcome

        return await self._retrying(committed, send, deadline=deadline, carrier=carrier, on_retry=on_retry)

    async def _retrying(
        self,
        committed: Sequence[int],
        send: Callable[[float], Awaitable[T]],
        *,
        deadline: float,
        carrier: Carrier,
        on_retry: Callable[[BaseException], None],
    ) -> T:
        """send(timeout), opening the session first when needed, retried within the budget (see the class)."""
        failing_since: float | None = None
        backoff = 0.05
        last = ""
        lost = 0  # re-opens in a row without a verdict
        while True:
            now = time.monotonic()
            budget_end = deadline if failing_since is None else min(deadline, failing_since + self.timeout_s)
            if now >= budget_end:
                why = f" ({last})" if last else ""
                if budget_end >= deadline:  # the request's own time ran out
                    raise DeadlineExceeded(f"the request's deadline passed before the target verified{why}")
                raise Unavailable(f"the target could not verify within its retry budget{why}")
            timeout = min(budget_end - now, self.timeout_s)
            self.touched = True
            try:
                if not self.opened:
                    await self.port.open(
                        steps.OpenRequest(self.session_id, committed, self.params), timeout=timeout, carrier=carrier
                    )
                    self.opened = True
                return await send(timeout)
            except (SessionNotFound, SessionOutOfSync) as exc:
                self.opened = False
                lost += 1
                if lost < 2:
                    continue
                failure: BaseException = Unavailable(f"the target lost the session twice in a row ({exc})")
            except (Unavailable, DeadlineExceeded) as exc:
                self.opened = False
                # the call's timeout was the time to the request's deadline (not the retry budget's)
                capped = (
                    isinstance(exc, DeadlineExceeded) and budget_end >= deadline and deadline - now < self.timeout_s
                )
                if capped or time.monotonic() >= deadline:  # the request's time is up: it ends, no retry logged
                    raise DeadlineExceeded(f"the request's deadline passed before the target verified ({exc})") from exc
                failure = exc
            lost = 0
            failing_since = failing_since if failing_since is not None else now
            last = f"{type(failure).__name__}: {failure}"
            on_retry(failure)
            await asyncio.sleep(min(backoff, max(0.0, budget_end - time.monotonic())))
            backoff = min(backoff * 2, 1.0)

    async def close(self, timeout: float) -> None:
        if self.touched:
            await self.port.close(steps.CloseRequest(self.session_id), timeout=timeout)


def _check(outcome: steps.VerifyOutcome, proposal: Proposal, defer_bonus: bool) -> None:
    """A verdict that cannot belong to this round means a peer out of step: Unavailable (retried)."""
    k = len(proposal)
    if not 0 <= outcome.accepted <= k:
        raise Unavailable(f"the target accepted {outcome.accepted} of {k} draft tokens")
    if outcome.deferred and not (defer_bonus and k > 0 and outcome.accepted == k):
        raise Unavailable("the target deferred a bonus it was not asked to defer")
