"""The verifier's sampling path: p computed where the rejection sampler reads it, failures per session."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import Internal, InvalidArgument
from specd.core.model.runner import KVSession
from specd.core.model.sim import parse_sim_spec
from specd.core.rounds.steps import ProposeRequest, VerifyOutcome, VerifyRequest
from specd.core.sampling import compact_q, sampler
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

SIM = "sim:h100-tp2-70b,vocab_size=2048,time_scale=0"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _round(params: list[SamplingParams], k: int = 4) -> tuple[Verifier, list[VerifyRequest]]:
    profile = parse_sim_spec(SIM)
    verifier, drafter = Verifier(profile.runner("target")), ModelDrafter(profile.runner("draft"))
    requests = []
    for n, sp in enumerate(params):
        sid = f"s{n}"
        verifier.open(sid, PROMPT, sp)
        drafter.open(sid, PROMPT, sp)
        proposal = drafter.propose(ProposeRequest(sid, len(PROMPT), len(PROMPT), [], k))
        requests.append(VerifyRequest(sid, len(PROMPT), proposal))
    return verifier, requests


def test_a_batch_verifies_what_each_session_verifies_alone() -> None:
    params = [SamplingParams(temperature=t, seed=s) for t, s in ((0.7, 1), (1.0, 2), (0.0, 3), (1.3, 4))]
    verifier, requests = _round(params)
    together = verifier.verify_batch(requests)
    for n, sp in enumerate(params):
        alone, [req] = _round([sp])
        got, want = together[n], alone.verify(VerifyRequest("s0", req.committed_length, requests[n].proposal))
        assert isinstance(got, VerifyOutcome) and (got.accepted, got.token_id) == (want.accepted, want.token_id)


def test_a_session_whose_p_is_not_a_distribution_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Finite logits whose x / T overflows float32: p is NaN where the sampler reads it.
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1e-4, seed=2)]
    verifier, requests = _round(params)
    logits_batch = verifier.runner.logits_batch

    def huge_second(sessions: list[KVSession], num_last: list[int], **kw: Any) -> list[torch.Tensor]:
        out = logits_batch(sessions, num_last, **kw)
        out[1] = out[1].clone()
        out[1][:, 0] = 1e36  # 1e36 / 1e-4 = inf
        return out

    monkeypatch.setattr(verifier.runner, "logits_batch", huge_second)
    ok, bad = verifier.verify_batch(requests)
    assert isinstance(ok, VerifyOutcome)
    assert isinstance(bad, Internal) and str(bad) == sampler.UNUSABLE_PROBS
    assert verifier._pool.get("s1").kv.tokens == PROMPT  # rolled back to the committed prefix


def test_a_proposal_that_breaks_a_sampler_rule_fails_alone() -> None:
    verifier, requests = _round([SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.7, seed=2)])
    p = requests[1].proposal
    assert p.q_ids is not None and p.q_probs is not None
    # q without mass at the draft token: not the distribution the token came from.
    broken = Proposal(p.token_ids, p.q_ids, torch.where(p.q_ids == p.token_ids[0], 0.0, p.q_probs))
    ok, bad = verifier.verify_batch([requests[0], VerifyRequest("s1", len(PROMPT), broken)])
    assert isinstance(ok, VerifyOutcome) and not isinstance(bad, VerifyOutcome)


def test_q_rows_left_in_the_wire_form_are_decoded_beside_the_forward_and_checked_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The target service leaves a model draft's compact q rows undecoded (Proposal.compact_q): the verifier
    decodes them while its forward runs (the runner's `beside`) and verifies exactly as with q decoded first.
    A row that fails its checks (here a draft token without weight in its own row) fails its own request
    alone, rolled back to its committed prefix, as it failed before the forward when the wire decoded it."""
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, seed=2)]
    verifier, requests = _round(params)
    decoded = [r.proposal for r in requests]
    rows = [tuple(compact_q.to_compact(p.q_ids, p.q_probs)) for p in decoded if p.q_ids is not None]
    assert len(rows) == 2
    lazy = [
        VerifyRequest(r.session_id, r.committed_length, Proposal(r.proposal.token_ids, compact_q=q))
        for r, q in zip(requests, rows)
    ]
    want = _round(params)[0].verify_batch(requests)
    besides: list[bool] = []
    logits_batch = verifier.runner.logits_batch

    def watched(sessions: list[KVSession], num_last: list[int], **kw: Any) -> list[torch.Tensor]:
        besides.append(kw.get("beside") is not None)
        return logits_batch(sessions, num_last, **kw)

    monkeypatch.setattr(verifier.runner, "logits_batch", watched)
    got = verifier.verify_batch(lazy)
    assert besides == [True]
    for g, w in zip(got, want):
        assert isinstance(g, VerifyOutcome) and isinstance(w, VerifyOutcome)
        assert (g.accepted, g.token_id, g.is_bonus) == (w.accepted, w.token_id, w.is_bonus)
    # a broken row: the first draft token's weight gone from its own row
    verifier, requests = _round(params)
    p = requests[1].proposal
    assert p.q_ids is not None and p.q_probs is not None
    broken = tuple(compact_q.to_compact(p.q_ids, torch.where(p.q_ids == p.token_ids[0], 0.0, p.q_probs)))
    ok, bad = verifier.verify_batch(
        [requests[0], VerifyRequest("s1", len(PROMPT), Proposal(p.token_ids, compact_q=broken))]
    )
    assert isinstance(ok, VerifyOutcome) and isinstance(bad, InvalidArgument)
    assert verifier._pool.get("s1").kv.tokens == PROMPT  # rolled back to the committed prefix
