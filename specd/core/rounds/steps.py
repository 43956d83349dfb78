"""The messages of a round's steps: what each port call asks and answers, and the prefix sync.

One request object per port call: `OpenRequest` and `CloseRequest` (both
ports), a draft's `ProposeRequest` and `BranchRequest`, a target's
`VerifyRequest` and `StageRequest`; the answers `Proposal`
(specd.core.sampling.proposal), `Branches`, `VerifyOutcome` and `StagedOutcome`; a tree round's `TreeProposeRequest`,
`TreeVerifyRequest` and `TreeVerifyOutcome` (docs/trees.md). The ports (specd.core.rounds.ports), the drafters, the
verifier and the wire translation (specd.serving.wire) all read and write
these, so a step's fields are spelled out once, here.

A service keeps one sequence per session. The caller tells it the committed
prefix as (start, tail): cut the sequence at `start`, append `tail`. Its own
earlier drafts that were accepted are already in the sequence, so the tail
is normally just the target's recovered or bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.phases import PhaseLog
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree
from specd.core.transit import Transit

DEFAULT_BRANCH_BUDGET = 8  # branches per round: on a GPU draft they cost about one batch row each
MAX_BRANCH_BUDGET = 64  # what a draft service drafts at most for one request's round


@dataclass(frozen=True)
class OpenRequest:
    """Open (or re-open) a session: build its sequence as token_ids (the committed tokens)."""

    session_id: str
    token_ids: Sequence[int]
    params: SamplingParams
    tenant: str = ""  # whose learned draft state the session may use (a draft's open only; "": none)
    confidence: bool = True  # a draft's open: the caller reads its tokens' confidence (auto); False: none needed


@dataclass(frozen=True)
class CloseRequest:
    """Forget a session.

    committed: its final committed sequence, of which the service holds the
    first `start`; a drafter that learns across sessions (suffix) indexes the
    whole answer. A target's close carries neither.
    """

    session_id: str
    committed: Sequence[int] = ()
    start: int = 0


@dataclass(frozen=True)
class ProposeRequest:
    """Draft after the committed prefix: one session's part of a (batched) drafting step.

    Roll the sequence back to its first `start` tokens, append `tail` (giving
    committed_length tokens), then draft up to num_tokens tokens after it; the
    drafts join the sequence.
    """

    session_id: str
    committed_length: int
    start: int
    tail: Sequence[int]
    num_tokens: int  # the draft length K
    # the first token guesses the target's bonus at that position (bonus-match): a model draft at T > 0
    # draws it with the target's coin (specd.core.sampling.bonus_guess)
    guess_bonus: bool = False


@dataclass(frozen=True)
class BranchRequest:
    """A speculation cache's branch call, one batched drafting pass for all branches.

    Bring the sequence to its prefix as a ProposeRequest does (committed_length
    tokens, the last `pending` of them the proposal being verified), choose up
    to `budget` verdicts of those pending tokens (specd.core.draft.branching)
    and draft num_tokens tokens after each. The branches are kept until the
    session's next call, which continues the one it extends; every branch
    shares the prefix's first committed_length - pending tokens, so that
    call's `start` must not exceed them.
    """

    session_id: str
    committed_length: int  # tokens of the prefix: the committed ones, then the `pending` being verified
    start: int
    tail: Sequence[int]
    pending: int  # the last `pending` tokens of the prefix are being verified (>= 1)
    num_tokens: int  # draft tokens per branch
    budget: int = DEFAULT_BRANCH_BUDGET  # branches at most
    acceptance: tuple[float, ...] = ()  # per pending position: P(accepted | the ones before accepted); () = default


@dataclass(frozen=True)
class Branch:
    """One verdict (accepted, token_id) of the pending tokens and the next round's drafts after it."""

    accepted: int  # pending tokens accepted
    token_id: int  # then the recovered (accepted < pending) or the bonus (accepted == pending) token
    proposal: Proposal  # draft tokens after committed + pending[:accepted] + [token_id]

    def extension(self, pending: Sequence[int]) -> tuple[int, ...]:
        """The tokens this branch assumes the round commits after the committed prefix."""
        return (*pending[: self.accepted], self.token_id)


@dataclass(frozen=True)
class Branches:
    """What a branch call returns: its branches (possibly none), likeliest first, and where the time went."""

    branches: tuple[Branch, ...]
    compute_ms: float = 0.0
    phases: PhaseLog = field(default_factory=PhaseLog, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.branches)


DraftWork = ProposeRequest | BranchRequest  # one step message of a draft service: a propose or a branch call


DraftResult = Proposal | Branches


@dataclass(frozen=True)
class VerifyRequest:
    """Verify `proposal` after the first committed_length tokens and commit the verdict.

    One session's part of a (batched) verification step. The round loop sends
    start = committed_length: the target rolls back any verdict the caller
    never saw.
    """

    session_id: str
    committed_length: int
    proposal: Proposal
    start: int | None = None  # (start, tail) patch the committed prefix, as in the drafter
    tail: Sequence[int] = ()
    # All drafts accepted: commit them only and leave the bonus position to the next
    # verify's first draft token (PEARL post-verify). Exact: that position then gets
    # an accept (or recover) coin instead of a bonus coin, never both.
    defer_bonus: bool = False


@dataclass(frozen=True)
class VerifyOutcome:
    """The target's verdict on a proposal, already committed there."""

    accepted: int  # draft tokens accepted (committed)
    token_id: int  # the recovered or bonus token (committed after them); -1 when deferred
    is_bonus: bool
    committed_length: int  # after this verdict
    compute_ms: float  # this session's wall time in the step (a batch's forward counts whole)
    phases: PhaseLog = field(default_factory=PhaseLog, compare=False, repr=False)  # where the time went
    deferred: bool = False  # all drafts accepted, bonus not drawn (VerifyRequest.defer_bonus)
    transit: Transit | None = field(default=None, compare=False, repr=False)  # the call's hops (a transport's port)


@dataclass(frozen=True)
class StagedRound:
    """One candidate of a staged verify: the verdict it assumes, and the next round's drafts after it."""

    accepted: int  # this round's draft tokens accepted ...
    token_id: int  # ... then its recovered or bonus token (-1 when deferred)
    proposal: Proposal  # the next round's drafts after committed + pending[:accepted] + [token_id]
    # The verdict it assumes defers the bonus (VerifyRequest.defer_bonus): all `accepted` drafts and no
    # token, so the next round's first draft sits at the bonus position (post-verify's pre-draft).
    deferred: bool = False
    defer_bonus: bool = False  # the candidate's own round defers its bonus (VerifyRequest.defer_bonus)

    def names(self, outcome: VerifyOutcome) -> bool:
        """Whether the verdict `outcome` is the one this candidate assumes."""
        if outcome.accepted != self.accepted or outcome.deferred != self.deferred:
            return False
        return self.deferred or outcome.token_id == self.token_id

    def committed_length(self, before: int) -> int:
        """The prefix the candidate's round verifies after: `before` plus what the assumed verdict commits."""
        return before + self.accepted + (0 if self.deferred else 1)


@dataclass(frozen=True)
class StageRequest:
    """The next round's verify, staged at the target while this round is verified (pipelined rounds).

    committed_length is this round's prefix (before its verdict). Once the target's own
    verdict on that round is known, it verifies the candidate that verdict is
    (`StagedRound.names`), at once, without waiting for the caller; otherwise it runs none.
    The caller still decides what it commits: a staged verdict it does not use is rolled
    back by its next message (start = its committed length).
    """

    session_id: str
    committed_length: int
    candidates: tuple[StagedRound, ...]


@dataclass(frozen=True)
class StagedOutcome:
    """What the target did with a StageRequest: the candidate it verified (and the verdict), or none."""

    candidate: int  # index into StageRequest.candidates; -1: none ran
    outcome: VerifyOutcome | None = None

    NONE: ClassVar[StagedOutcome]


StagedOutcome.NONE = StagedOutcome(-1)


@dataclass(frozen=True)
class TreeProposeRequest:
    """Draft a tree after the committed prefix (synced as a ProposeRequest's): at most `budget` nodes,
    at most `depth` deep. The sequence stays the committed prefix (the nodes do not join it)."""

    session_id: str
    committed_length: int
    start: int
    tail: Sequence[int]
    budget: int  # nodes at most
    depth: int  # levels at most (a chain's K)


@dataclass(frozen=True)
class TreeVerifyRequest:
    """Verify `tree` after the first committed_length tokens and commit the accepted path and one token."""

    session_id: str
    committed_length: int
    tree: DraftTree
    start: int | None = None  # (start, tail) patch the committed prefix, as in VerifyRequest
    tail: Sequence[int] = ()


@dataclass(frozen=True)
class TreeVerifyOutcome:
    """The target's verdict on a tree, already committed there: the path's tokens, then token_id."""

    path: tuple[int, ...]  # accepted node indices, root first
    tokens: tuple[int, ...]  # their token ids
    token_id: int  # the recovered or bonus token
    is_bonus: bool
    committed_length: int  # after this verdict
    compute_ms: float = 0.0
    phases: PhaseLog = field(default_factory=PhaseLog, compare=False, repr=False)

    @property
    def accepted(self) -> int:
        return len(self.path)


def check_tree_budget(budget: int, depth: int) -> None:
    """InvalidArgument unless a tree request asks for at least one node and one level."""
    if budget < 1 or depth < 1:
        raise InvalidArgument(f"a tree needs budget >= 1 node and depth >= 1 level (got {budget}, {depth})")


def check_prompt(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """An open's tokens as ints, or InvalidArgument: at least one, each within [0, vocab_size)."""
    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise InvalidArgument("the prompt is empty; send at least one token")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise InvalidArgument(f"a token id is outside the vocabulary [0, {vocab_size})")
    return tokens


def check_num_tokens(num_tokens: int) -> int:
    """num_tokens, or InvalidArgument when a propose or branch call asks for no draft token."""
    if num_tokens < 1:
        raise InvalidArgument(f"num_tokens must be >= 1 (got {num_tokens})")
    return num_tokens


def check_sync(held: int, committed_length: int, start: int, tail: Sequence[int]) -> None:
    """OutOfSync unless a (start, tail) update of a `held`-token sequence gives committed_length tokens."""
    if start > held:
        raise SessionOutOfSync(f"update starts at {start} but the session holds {held} tokens; re-open")
    if start + len(tail) != committed_length:
        raise SessionOutOfSync(
            f"update gives {start + len(tail)} committed tokens, message says {committed_length}; re-open"
        )


def sync_prefix(tokens: list[int], committed_length: int, start: int, tail: Sequence[int]) -> list[int]:
    """The committed prefix from a (start, tail) update; OutOfSync if it cannot be built.

    tokens: the service's current sequence, whose first `start` tokens the
    caller declares committed (its own accepted drafts among them).
    """
    check_sync(len(tokens), committed_length, start, tail)
    return tokens[:start] + [int(t) for t in tail]
