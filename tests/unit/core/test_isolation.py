"""One request never hurts another: a hostile row in a batched pass fails alone, in-process.

The batches here hold ordinary sessions beside hostile ones: a temperature of
1e-45 (which once divided float32 logits into inf/NaN and failed every row
through an `assert`), a session whose model numbers are NaN (a model with one
poisoned embedding row, the prompt containing that token), and a proposal that
breaks the sampler's rules. The ordinary rows must come out exactly as when
run alone; the hostile rows get their own exception; nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from specd.core import errors
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import Internal, InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest, VerifyOutcome, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import MAX_TEMPERATURE, TEMPERATURE_FLOOR, SamplingParams, processed_probs
from specd.core.target.verifier import Verifier
from specd.serving.grpc_errors import INTERNAL_MESSAGE, exception_from_session_error, session_error, status_for
from specd.serving.wire import params_to_proto
from specd.v1 import common_pb2, session_pb2, target_pb2
from target_service.servicer import TargetServicer

POISON = 200  # a byte no ordinary prompt below contains; its embedding row is NaN in the poisoned models
# Lengths within a factor of two: the first verify prefills them, and the verifier
# gives a much longer prefill a pass of its own (sessions.KVBudget.forward_groups).
PROMPTS = [
    "hello world",
    "def f(x):\n    return",
    "abcabcabcabc",
    "The end. Fin.",
    "xxxxxxxxxxxxx",
    "a longer prompt",
    "speculative decoding",
    "0123456789",
]
ORDINARY = [
    SamplingParams(temperature=0.0, seed=1),
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(temperature=0.7, top_k=20, seed=4),
    SamplingParams(temperature=0.0, seed=5),
    SamplingParams(temperature=1.3, min_p=0.05, seed=6),
    SamplingParams(temperature=0.5, seed=7),
    SamplingParams(temperature=0.9, top_p=0.5, top_k=5, seed=8),
]


def _poisoned(folder: Path):
    """A fresh copy of the model whose embedding row POISON is NaN: any context holding that token is NaN."""
    loaded = load_pretrained(folder)
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[POISON] = float("nan")
    return loaded


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = _poisoned(target), _poisoned(draft)
    ids = [t.tokenizer(p).input_ids for p in PROMPTS]
    assert all(POISON not in p for p in ids)
    return t, d, ids


# ---- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1e-45, 5e-324, 1e-30, TEMPERATURE_FLOOR / 2])
def test_temperatures_below_the_floor_are_greedy(t: float) -> None:
    sp = SamplingParams(temperature=t).validate()
    assert sp.is_greedy
    logits = (torch.randn(1, 3, 50) * 30).expand(2, 3, 50)
    p = processed_probs(logits, [sp, SamplingParams(temperature=0.0)])
    assert bool(torch.isfinite(p).all())
    assert torch.equal(p[0], p[1])  # the same one-hot as temperature 0


def test_the_floor_itself_samples() -> None:
    sp = SamplingParams(temperature=TEMPERATURE_FLOOR).validate()
    assert not sp.is_greedy
    p = processed_probs(torch.randn(1, 2, 50) * 1e3, [sp])
    assert bool(torch.isfinite(p).all()) and torch.allclose(p.sum(-1), torch.ones(1, 2))


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -1e-45}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"temperature": 1e300}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": math.inf}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"min_p": -math.inf}, "min_p"),
        ({"top_k": 2**40}, "top_k"),
    ],
)
def test_every_float_setting_is_finite_and_in_range(fields: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        SamplingParams(**fields).validate()


# ---- the verifier ----------------------------------------------------------------------------


def _q(token: int, other: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-token sparse q per position: the draft token at 0.6, another at 0.4."""
    return torch.tensor([[token, other]]), torch.tensor([[0.6, 0.4]])


def _proposals(ids: list[list[int]]) -> list[Proposal]:
    """Fixed drafts per ordinary session: different K, some one-hot, some with sparse q."""
    out = []
    for i, prompt in enumerate(ids):
        tokens = [(prompt[-1] + 3 * j + i) % 190 for j in range(1 + i % 4)]  # never POISON
        if i % 2:
            qi = torch.cat([_q(t, (t + 1) % 190)[0] for t in tokens])
            qp = torch.cat([_q(t, (t + 1) % 190)[1] for t in tokens])
            out.append(Proposal(tokens, qi, qp))
        else:
            out.append(Proposal(tokens))
    return out


def _alone(runner: CausalLMRunner, prompt: list[int], params: SamplingParams, proposal: Proposal) -> VerifyOutcome:
    v = Verifier(runner)
    v.open("alone", prompt, params)
    return v.verify(VerifyRequest("alone", len(prompt), proposal))


def test_a_hostile_row_fails_alone_in_a_verify_batch(models) -> None:
    t, _, ids = models
    runner = CausalLMRunner(t.model)
    proposals = _proposals(ids)
    want = [_alone(runner, p, sp, pr) for p, sp, pr in zip(ids, ORDINARY, proposals)]
    want_greedy = _alone(runner, ids[2], SamplingParams(temperature=0.0, seed=9), Proposal([5, 6]))

    v = Verifier(runner)
    requests = []
    for i, (p, sp, pr) in enumerate(zip(ids, ORDINARY, proposals)):
        v.open(f"s{i}", p, sp)
        requests.append(VerifyRequest(f"s{i}", len(p), pr))
    # 1e-45: greedy below the floor (it used to overflow and fail the whole batch).
    v.open("tiny-t", ids[2], SamplingParams(temperature=1e-45, seed=9))
    # NaN logits: the prompt holds the poisoned token.
    poisoned = [*ids[0], POISON]
    v.open("nan", poisoned, SamplingParams(temperature=0.7, seed=10))
    # A draft token outside its own q: the sampler's rule, checked per row.
    v.open("bad-q", ids[3], SamplingParams(temperature=0.7, seed=11))
    bad_q = Proposal([7], torch.tensor([[8]]), torch.tensor([[1.0]]))
    hostile = [
        VerifyRequest("tiny-t", len(ids[2]), Proposal([5, 6])),
        VerifyRequest("nan", len(poisoned), Proposal([5, 6])),
        VerifyRequest("bad-q", len(ids[3]), bad_q),
    ]
    mixed = requests[:4] + hostile + requests[4:]
    results = v.verify_batch(mixed)

    ordinary = results[:4] + results[7:]
    for got, expect in zip(ordinary, want):
        assert isinstance(got, VerifyOutcome), got
        assert (got.accepted, got.token_id, got.is_bonus, got.committed_length) == (
            expect.accepted,
            expect.token_id,
            expect.is_bonus,
            expect.committed_length,
        )
        assert got.phases.batch_size == len(mixed)  # they really shared the forward with the hostile rows
    tiny_t, nan, bad = results[4:7]
    assert isinstance(tiny_t, VerifyOutcome)
    assert (tiny_t.accepted, tiny_t.token_id) == (want_greedy.accepted, want_greedy.token_id)
    assert isinstance(nan, Internal), nan
    assert isinstance(bad, InvalidArgument) and "support" in str(bad), bad

    # The failed rows were rolled back to their committed prefix; everyone goes on.
    assert v._pool.get("nan").kv.tokens == poisoned
    assert v._pool.get("bad-q").kv.tokens == ids[3]
    again = v.verify_batch(
        [VerifyRequest(f"s{i}", want[i].committed_length, Proposal([])) for i in range(len(ids))]
        + [VerifyRequest("bad-q", len(ids[3]), Proposal([7]))]
    )
    assert all(isinstance(r, VerifyOutcome) for r in again), again


def test_an_assert_free_sampler_names_the_row_it_refuses(models) -> None:
    """The rejection sampler's per-row checks raise InvalidArgument, never AssertionError."""
    t, _, ids = models
    v = Verifier(CausalLMRunner(t.model))
    v.open("a", ids[0], SamplingParams(temperature=0.7, seed=1))
    zero_q = Proposal([7], torch.tensor([[7]]), torch.tensor([[0.0]]))
    result = v.verify_batch([VerifyRequest("a", len(ids[0]), zero_q)])[0]
    assert isinstance(result, InvalidArgument), result


# ---- the drafter -----------------------------------------------------------------------------


def _draft_alone(runner: CausalLMRunner, prompt: list[int], params: SamplingParams, k: int) -> Proposal:
    d = ModelDrafter(runner, wire_top_k=4)
    d.open("alone", prompt, params)
    return d.propose(ProposeRequest("alone", len(prompt), len(prompt), [], k))


def test_a_hostile_row_fails_alone_in_a_draft_batch(models) -> None:
    _, d, ids = models
    runner = CausalLMRunner(d.model)
    ks = [1 + i % 4 for i in range(len(ids))]
    want = [_draft_alone(runner, p, sp, k) for p, sp, k in zip(ids, ORDINARY, ks)]
    want_greedy = _draft_alone(runner, ids[2], SamplingParams(temperature=0.0, seed=9), 3)

    drafter = ModelDrafter(runner, wire_top_k=4)
    requests = []
    for i, (p, sp, k) in enumerate(zip(ids, ORDINARY, ks)):
        drafter.open(f"s{i}", p, sp)
        requests.append(ProposeRequest(f"s{i}", len(p), len(p), [], k))
    drafter.open("tiny-t", ids[2], SamplingParams(temperature=1e-45, seed=9))
    poisoned = [*ids[0], POISON]
    drafter.open("nan", poisoned, SamplingParams(temperature=0.7, seed=10))
    drafter.open("nan-greedy", poisoned, SamplingParams(temperature=0.0, seed=10))
    hostile = [
        ProposeRequest("tiny-t", len(ids[2]), len(ids[2]), [], 3),
        ProposeRequest("nan", len(poisoned), len(poisoned), [], 3),
        ProposeRequest("nan-greedy", len(poisoned), len(poisoned), [], 3),
    ]
    results = drafter.propose_batch(requests[:4] + hostile + requests[4:])

    for got, expect in zip(results[:4] + results[7:], want):
        assert isinstance(got, Proposal), got
        assert got.token_ids == expect.token_ids
        assert (got.q_ids is None and expect.q_ids is None) or torch.equal(got.q_ids, expect.q_ids)
        # q's integer weights: a batched forward may move one by a grid step (the tokens do not move)
        assert (got.q_probs is None and expect.q_probs is None) or bool(
            ((got.q_probs - expect.q_probs).abs() <= 1).all()
        )
    tiny_t, nan, nan_greedy = results[4:7]
    assert isinstance(tiny_t, Proposal) and tiny_t.token_ids == want_greedy.token_ids and tiny_t.q_ids is None
    assert isinstance(nan, Internal), nan
    assert isinstance(nan_greedy, Internal), nan_greedy
    assert drafter._pool.get("nan").kv.tokens == poisoned  # rolled back to the committed prefix

    # Every ordinary session drafts on from where it is.
    again = drafter.propose_batch([ProposeRequest(f"s{i}", len(ids[i]), len(ids[i]), [], 2) for i in range(len(ids))])
    assert all(isinstance(r, Proposal) and len(r) == 2 for r in again), again


# ---- error codes ------------------------------------------------------------------------------


def test_a_requests_own_errors_are_never_read_as_retryable() -> None:
    for exc in (InvalidArgument("bad settings"), Internal("row 3 is NaN")):
        back = exception_from_session_error(session_error(exc))
        assert type(back) is type(exc) and isinstance(back, errors.REQUEST_ERRORS)
    assert status_for(Internal("row 3 is NaN at 0x7f")) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    assert status_for(InvalidArgument("top_p must be in (0, 1]"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # A bug (not a domain error) in a session: INTERNAL in-band, read back as Internal, not Unavailable.
    back = exception_from_session_error(session_error(AssertionError("oops")))
    assert isinstance(back, Internal) and "oops" not in str(back)


# ---- internal limits: sizes are checked before anything is allocated ----------------------------


class _Untouchable(Sequence):
    """A sequence that only knows its length: any read means the check came too late."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        raise AssertionError("read before the size check")


def test_a_proposal_over_the_limits_is_refused_from_its_lengths_alone() -> None:
    with pytest.raises(InvalidArgument, match="at most 32"):
        Proposal.from_wire(_Untouchable(10_000), _Untouchable(10_000), 259, max_draft_tokens=32)
    with pytest.raises(InvalidArgument, match="limit is 259"):  # capped by the vocabulary too
        Proposal.from_wire([1], [(_Untouchable(1_000_000), _Untouchable(1_000_000))], 259)
    with pytest.raises(InvalidArgument, match="limit is 64"):
        Proposal.from_wire([1], [(_Untouchable(100), _Untouchable(100))], 50_000, max_q_width=64)
    with pytest.raises(InvalidArgument, match="positions"):
        Proposal.from_wire([1, 2], [([1], [1.0])] * 3, 259)
    ok = Proposal.from_wire([1, 2], [([1, 5], [0.5, 0.5]), ([2], [1.0])], 259, max_draft_tokens=2, max_q_width=2)
    assert ok.q_ids is not None and tuple(ok.q_ids.shape) == (2, 2)


def test_hostile_internal_verifies_fail_alone_beside_eight_ordinary_ones(models) -> None:
    t, _, ids = models
    runner = CausalLMRunner(t.model)
    proposals = _proposals(ids)

    def servicer() -> TargetServicer:
        verifier = Verifier(runner, max_draft_tokens=16, max_q_width=64)
        return TargetServicer(verifier, ThreadPoolExecutor(1), common_pb2.ModelInfo())

    def opening(sid: str, prompt: list[int], sp: SamplingParams) -> target_pb2.TargetRequest:
        req = target_pb2.TargetRequest(session_id=sid, committed_length=len(prompt))
        req.open.token_ids.extend(prompt)
        req.open.sampling.CopyFrom(params_to_proto(sp))
        return req

    def verify(sid: str, committed: int, pr: Proposal) -> target_pb2.TargetRequest:
        req = target_pb2.TargetRequest(session_id=sid, committed_length=committed)
        req.verify.start = committed
        req.verify.draft_token_ids.extend(pr.token_ids)
        for row_ids, row_probs in pr.to_wire():
            req.verify.q.add(token_ids=row_ids, probs=row_probs)
        return req

    alone = []
    for i, (p, sp, pr) in enumerate(zip(ids, ORDINARY, proposals)):
        s = servicer()
        s.handle_batch([opening(f"s{i}", p, sp)])
        alone.append(s.handle_batch([verify(f"s{i}", len(p), pr)])[0])

    s = servicer()
    s.handle_batch([opening(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(ids, ORDINARY))])
    s.handle_batch([opening(f"h{j}", ids[0], SamplingParams(temperature=0.7, seed=j)) for j in range(3)])
    big_k = target_pb2.TargetRequest(session_id="h0", committed_length=len(ids[0]))
    big_k.verify.start = len(ids[0])
    big_k.verify.draft_token_ids.extend([1] * 10_000)
    wide = verify("h1", len(ids[0]), Proposal([1]))
    wide.verify.q.add(token_ids=list(range(1_000_000)), probs=[1.0] * 1_000_000)
    long_tail = verify("h2", len(ids[0]), Proposal([1]))
    long_tail.verify.token_ids.extend([1] * 100_000)
    batch = [verify(f"s{i}", len(p), pr) for i, (p, pr) in enumerate(zip(ids, proposals))]
    out = s.handle_batch(batch[:4] + [big_k, wide, long_tail] + batch[4:])

    for got, want in zip(out[:4] + out[7:], alone):
        assert got.WhichOneof("result") == "verdict", got
        assert got.verdict.accepted == want.verdict.accepted and got.verdict.token_id == want.verdict.token_id
        assert got.committed_length == want.committed_length
    for hostile in out[4:7]:
        assert hostile.error.code == session_pb2.SessionError.CODE_INVALID_ARGUMENT, hostile


def test_errors_about_peers_reach_clients_as_generic_messages() -> None:
    code, message = status_for(errors.Unavailable("target stream broke: UNAVAILABLE: ipv4:10.0.0.5:50053 refused"))
    assert code == grpc.StatusCode.UNAVAILABLE and "10.0.0.5" not in message and "retry" in message
    code, message = status_for(errors.DeadlineExceeded("target did not answer within 2.00 s"))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "2.00" not in message
    code, message = status_for(errors.ResourceExhausted("the coordinator is serving its limit of 4 requests"))
    assert message == "the coordinator is serving its limit of 4 requests"  # meant for the caller: kept
