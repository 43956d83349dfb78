"""The draft's q rows are built by the stream, off the model thread (BatchedRoundServicer.late_fill)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from draft_service.servicer import DraftServicer
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.lm import SimLM, SimShape
from specd.core.model.sim.sim_runner import SimRunner
from specd.core.sampling import compact_q
from specd.serving.streams import Stamped
from specd.v1 import common_pb2, draft_pb2

SHAPE = SimShape(vocab_size=1000, context_tokens=3, head=16, seed=7)
PROMPT = [5, 17, 99, 3]


def _servicer(pool: ThreadPoolExecutor, encode_q: bool = False) -> DraftServicer:
    runner = SimRunner(SimLM(SHAPE, agreement=0.7), CostModel(fixed_ms=0.0), max_context=256, kv_bytes_per_token=1)
    return DraftServicer(ModelDrafter(runner, encode_q=encode_q), pool, common_pb2.ModelInfo(), 8)


def _open(servicer: DraftServicer, sid: str, temperature: float) -> None:
    req = draft_pb2.DraftRequest(session_id=sid, committed_length=len(PROMPT))
    req.open.token_ids.extend(PROMPT)
    req.open.sampling.temperature, req.open.sampling.seed = temperature, 3
    assert servicer.run_other(req).HasField("ack")


def _steps() -> list[draft_pb2.DraftRequest]:
    propose = draft_pb2.DraftRequest(session_id="p", committed_length=len(PROMPT))
    propose.propose.start, propose.propose.num_tokens = len(PROMPT), 3
    branch = draft_pb2.DraftRequest(session_id="b", committed_length=len(PROMPT) + 2)
    b = branch.branches
    b.start, b.pending, b.num_tokens, b.budget = len(PROMPT), 2, 2, 4  # ranks the verdicts of 2 pending tokens
    b.token_ids.extend([40, 41])
    return [propose, branch]


def _run(stamped: bool, temperature: float, encode_q: bool = False) -> list[draft_pb2.DraftResponse]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = _servicer(pool, encode_q)
        _open(servicer, "p", temperature)
        _open(servicer, "b", temperature)
        if not stamped:
            return servicer.handle_batch(_steps())
        items = [Stamped(req, 0) for req in _steps()]
        out = servicer.handle_stamped(items)
        for item, resp in zip(items, out):
            assert isinstance(resp, draft_pb2.DraftResponse)
            if temperature > 0 and resp.HasField("branches"):  # the branches' q rows wait for the stream
                assert item.finish is not None
                assert not any(b.proposal.q for b in resp.branches.branches)
                item.finish()
            else:  # greedy (no q), or a propose (its q is built on the model thread: its round waits)
                assert item.finish is None
        return [r for r in out if isinstance(r, draft_pb2.DraftResponse)]


def _untimed(resp: draft_pb2.DraftResponse) -> bytes:
    """The response without its clocks (compute_ms differs from run to run)."""
    if resp.HasField("proposal"):
        resp.proposal.compute_ms = 0.0
    if resp.HasField("branches"):  # (proposal and branches share a oneof: touch only the one set)
        resp.branches.compute_ms = 0.0
        for b in resp.branches.branches:
            b.proposal.compute_ms = 0.0
    return resp.SerializeToString(deterministic=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_stream_gets_the_same_responses_as_a_direct_call(temperature: float) -> None:
    direct, streamed = _run(False, temperature), _run(True, temperature)
    assert [r.WhichOneof("result") for r in direct] == ["proposal", "branches"]  # no error stands in for them
    assert len(direct[1].branches.branches) >= 2
    assert [_untimed(r) for r in direct] == [_untimed(r) for r in streamed]
    if temperature > 0:
        assert direct[0].proposal.q and all(b.proposal.q for b in direct[1].branches.branches)


@pytest.mark.parametrize("stamped", [False, True])
def test_q_rows_the_drafter_encoded_during_its_passes_go_out_as_the_stream_would_encode_them(
    stamped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft service's drafter encodes each step's q rows while its next pass runs (encode_q); the
    messages are byte for byte those of a drafter that leaves the encoding to the servicer, which then
    encodes nothing itself (it would ask whether the weights are integers first)."""
    plain = _run(stamped, 0.8)

    def not_again(weights: object) -> bool:
        raise AssertionError("the servicer encoded q rows the drafter had encoded")

    monkeypatch.setattr(compact_q, "is_integral", not_again)
    encoded = _run(stamped, 0.8, encode_q=True)
    assert encoded[0].proposal.q and all(b.proposal.q for b in encoded[1].branches.branches)
    assert [_untimed(r) for r in plain] == [_untimed(r) for r in encoded]


def test_a_late_fill_that_fails_answers_its_message_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(proposals: object) -> list[object]:
        raise RuntimeError("encoding broke")

    monkeypatch.setattr("draft_service.servicer.sparse_rows_to_proto", broken)
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = _servicer(pool)
        _open(servicer, "b", 0.8)
        items = [Stamped(_steps()[1], 0)]
        (resp,) = servicer.handle_stamped(items)
        assert items[0].finish is not None
        items[0].finish()
    assert isinstance(resp, draft_pb2.DraftResponse)
    assert resp.WhichOneof("result") == "error" and resp.session_id == "b"
