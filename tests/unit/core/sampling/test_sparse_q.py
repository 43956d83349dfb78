"""The sparse q by mass: what the builder keeps, the compact wire form, the drafter and the draft metrics.

Exactness of sampling from it is tested statistically in test_sampling_stats.py.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from draft_service.servicer import DraftServicer
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import InvalidArgument
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling import compact_q, sampler, sparse_q
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.sparse_q import QSettings
from specd.serving.config import DraftConfig
from specd.serving.metrics import DraftMetrics
from specd.serving.wire import proposal_from_proto, proposal_to_proto, q_wire_bytes
from specd.v1 import common_pb2, draft_pb2
from tests.unit.core.sampling import reference
from tests.unit.core.sampling.tables import F32, F64


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # [1, V]


def _kept(ids: torch.Tensor, weights: torch.Tensor) -> dict[int, int]:
    return {int(i): int(w) for i, w in zip(ids, weights) if w > 0}


# ---- the builder -------------------------------------------------------------


def test_keeps_the_fewest_tokens_whose_mass_reaches_one_minus_epsilon() -> None:
    p = _row(0.05, 0.5, 0.3, 0.1, 0.04, 0.01)  # sorted: 1 (.5), 2 (.3), 3 (.1), 0 (.05), 4 (.04), 5 (.01)
    cases = {0.25: {1, 2}, 0.15: {1, 2, 3}, 0.05: {1, 2, 3, 0}, 0.011: {1, 2, 3, 0, 4}, 0.009: set(range(6))}
    for eps, want in cases.items():
        ids, w = sparse_q.build(p, QSettings(epsilon=eps, max_tokens=64, bits=20))
        assert set(_kept(ids[0], w[0])) == want, f"epsilon {eps}"
        assert (w[0] > 0).sum() == len(want) and bool((w[0][: len(want)] > 0).all())  # a prefix of the slots


def test_the_budget_caps_and_epsilon_zero_is_a_fixed_top_k() -> None:
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    ids, w = sparse_q.build(p, QSettings(epsilon=1e-6, max_tokens=7))
    assert ids.shape == (3, 7) and bool((w > 0).all())
    top7 = torch.topk(p, 7, dim=-1).indices
    assert all(set(ids[a].tolist()) == set(top7[a].tolist()) for a in range(3))
    ids0, w0 = sparse_q.build(p, QSettings.top_k(7))
    assert torch.equal(ids0, ids) and torch.equal(w0, w)


def test_weights_are_integers_on_the_grid_and_zero_probability_tokens_are_never_sent() -> None:
    p = _row(0.0, 0.7, 0.0, 0.2, 0.1, 0.0)  # a top-p filtered row: exact zeros
    ids, w = sparse_q.build(p, QSettings(epsilon=0.0, max_tokens=6, bits=10))
    assert _kept(ids[0], w[0]) == {1: 717, 3: 205, 4: 102}  # round(t * 1024), t renormalised over the kept
    assert compact_q.is_integral(w)
    # a value below half a grid step rounds to 0 and is dropped (its id is not sent)
    ids, w = sparse_q.build(_row(0.999, 0.0004, 0.0006), QSettings(epsilon=0.0, max_tokens=3, bits=10))
    assert _kept(ids[0], w[0]) == {0: 1023, 2: 1}


def test_the_top_token_always_survives_a_coarse_grid() -> None:
    p = torch.full((1, 64), 1 / 64)
    _, w = sparse_q.build(p, QSettings(epsilon=0.0, max_tokens=64, bits=2))  # every 1/64 rounds to 0 on a 1/4 grid
    assert (w > 0).sum() == 1 and float(w[0, 0]) == 1.0


# 300: float32 rows take the host selection; 200 (no wider than its first top-k): one top-k for the batch
@pytest.mark.parametrize("vocab", [300, 200])
def test_rows_have_their_own_widths_and_do_not_depend_on_their_batch_mates(vocab: int) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=g) * torch.tensor([[0.5], [4.0], [1.0], [8.0]])  # flat .. peaked
    p = torch.softmax(logits, -1)
    settings = QSettings(epsilon=1e-3, max_tokens=256, bits=20)
    ids, w = sparse_q.build(p, settings)
    widths = (w > 0).sum(-1).tolist()
    assert len(set(widths)) > 1 and ids.shape[1] == max(widths)
    for a in range(4):
        alone_ids, alone_w = sparse_q.build(p[a : a + 1], settings)
        assert _kept(alone_ids[0], alone_w[0]) == _kept(ids[a], w[a])


def test_kept_mass_is_at_least_one_minus_epsilon_unless_the_budget_binds() -> None:
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(32, 1000, generator=g) * 2.0, -1)
    for eps, budget in ((1e-2, 1000), (1e-3, 1000), (1e-3, 20)):
        ids, w = sparse_q.build(p, QSettings(epsilon=eps, max_tokens=budget))
        vals = p.gather(-1, ids).masked_fill(w == 0, 0.0)  # [A, W] the kept tokens' probabilities
        mass, width = vals.sum(-1), (w > 0).sum(-1)
        if budget == 1000:
            assert bool((mass >= 1 - eps - 1e-6).all())
            # the fewest: without its last (smallest) token every row falls short
            last = vals.gather(-1, (width - 1)[:, None])[:, 0]
            assert bool((mass - last < 1 - eps).all())
        else:
            assert bool((width == budget).all()) and bool((mass < 1 - eps).all())


def test_settings_are_validated() -> None:
    for bad in (QSettings(epsilon=1.0), QSettings(epsilon=-0.1), QSettings(max_tokens=0), QSettings(bits=25)):
        with pytest.raises(InvalidArgument):
            bad.validate()


def test_draft_samples_a_token_of_its_own_q_with_the_draft_coin() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 500, generator=g) * 1.5, -1)
    seeds, positions = torch.arange(64), torch.full((64,), 9)
    tok, ids, w = sparse_q.draft(p, QSettings(epsilon=1e-2, max_tokens=100), seeds, positions)
    assert all(float(w[a][ids[a] == tok[a]].sum()) > 0 for a in range(64))
    again, _, _ = sparse_q.draft(p, QSettings(epsilon=1e-2, max_tokens=100), seeds, positions)
    assert torch.equal(tok, again)  # coins depend on (seed, position) only


# ---- the drafter and the draft service ----------------------------------------


@pytest.fixture(scope="module")
def tiny_target(tiny_pair: tuple[Path, Path]):
    return load_pretrained(tiny_pair[0])


def _propose_batch(drafter: ModelDrafter, prompts: list[list[int]], k: int) -> list[Proposal]:
    out = drafter.propose_batch([ProposeRequest(f"s{i}", len(p), len(p), [], k) for i, p in enumerate(prompts)])
    assert all(isinstance(o, Proposal) for o in out)
    return out  # type: ignore[return-value]


def test_batched_drafting_sends_rows_of_their_own_widths(tiny_target) -> None:
    drafter = ModelDrafter(CausalLMRunner(tiny_target.model), q=QSettings(epsilon=1e-3, max_tokens=200))
    prompts = [tiny_target.tokenizer(t).input_ids for t in ("hello world", "abcabc", "x")]
    for i, p in enumerate(prompts):
        drafter.open(f"s{i}", p, SamplingParams(temperature=(0.5, 1.0, 2.0)[i], seed=i))
    batched = _propose_batch(drafter, prompts, 4)
    widths = {int(w) for prop in batched for w in (prop.q_probs > 0).sum(-1)}
    assert len(widths) > 1 and max(widths) <= 200
    for prop in batched:
        wire = proposal_to_proto(prop)
        proposal_from_proto(wire, drafter.vocab_size)  # what the target accepts
        assert prop.q_ms > 0
    # one session at a time: the same tokens and the same q (a batched forward may move a weight by one step)
    for i, p in enumerate(prompts):
        drafter.open(f"s{i}", p, SamplingParams(temperature=(0.5, 1.0, 2.0)[i], seed=i))
    for i, p in enumerate(prompts):
        alone = drafter.propose(ProposeRequest(f"s{i}", len(p), len(p), [], 4))
        assert alone.token_ids == batched[i].token_ids
        for k in range(4):
            one, many = _kept(alone.q_ids[k], alone.q_probs[k]), _kept(batched[i].q_ids[k], batched[i].q_probs[k])
            assert one.keys() == many.keys() and all(abs(one[t] - many[t]) <= 1 for t in one)


def test_a_fixed_top_k_per_server_or_per_session(tiny_target) -> None:
    drafter = ModelDrafter(CausalLMRunner(tiny_target.model), wire_top_k=3)
    prompt = tiny_target.tokenizer("top k").input_ids
    drafter.open("a", prompt, SamplingParams(temperature=1.5, seed=1))
    drafter.open("b", prompt, SamplingParams(temperature=1.5, seed=1), wire_top_k=5)
    a, b = (drafter.propose(ProposeRequest(s, len(prompt), len(prompt), [], 3)) for s in ("a", "b"))
    assert a.q_ids.shape[1] == 3 and b.q_ids.shape[1] == 5
    greedy = ModelDrafter(CausalLMRunner(tiny_target.model))
    greedy.open("g", prompt, SamplingParams(temperature=0.0))
    assert greedy.propose(ProposeRequest("g", len(prompt), len(prompt), [], 3)).q_ids is None  # greedy sends IDs only


def test_draft_config_flags() -> None:
    assert DraftConfig().q_settings == QSettings()
    assert DraftConfig(wire_top_k=8, wire_bits=16).q_settings == QSettings(epsilon=0.0, max_tokens=8, bits=16)
    assert DraftConfig(q_epsilon=0.01, q_max_tokens=64).q_settings == QSettings(0.01, 64, QSettings.bits)
    for bad in (dict(q_epsilon=1.0), dict(q_max_tokens=0), dict(wire_top_k=-1), dict(wire_bits=25)):
        with pytest.raises(InvalidArgument):
            DraftConfig(**bad).validate()


def _samples(registry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_draft_service_exports_q_bytes_and_build_time(tiny_target) -> None:
    metrics = DraftMetrics()
    drafter = ModelDrafter(CausalLMRunner(tiny_target.model))
    prompt = tiny_target.tokenizer("metrics").input_ids
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = DraftServicer(drafter, pool, common_pb2.ModelInfo(), 8, metrics=metrics)
        sent: list[int] = []
        for sid, temperature in (("t", 1.0), ("g", 0.0)):
            req = draft_pb2.DraftRequest(session_id=sid, committed_length=len(prompt))
            req.open.token_ids.extend(prompt)
            req.open.sampling.temperature = temperature
            assert servicer.run_other(req).HasField("ack")
            step = draft_pb2.DraftRequest(session_id=sid, committed_length=len(prompt))
            step.propose.start, step.propose.num_tokens = len(prompt), 3
            ((resp, _),) = servicer.run_steps([step])
            sent += q_wire_bytes(resp.proposal)
    got = _samples(metrics.registry)
    assert len(sent) == 3  # the greedy session sent no q
    assert got["specd:draft_q_bytes_count"] == 3 and got["specd:draft_q_bytes_sum"] == sum(sent)
    assert got["specd:draft_q_build_seconds_count"] == 1 and got["specd:draft_q_build_seconds_sum"] > 0


def test_the_partial_first_selection_keeps_exactly_what_the_full_top_k_keeps(monkeypatch) -> None:
    # Rows from sharp (a few tokens keep the mass) to flat (over a thousand do), in one batch; float64,
    # so that they take the top-k where they live (float32 host rows take the histogram: test_fast_paths.py).
    g = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(6, 5000, generator=g) * torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.1])[:, None], -1)
    probs = probs.double()
    settings = sparse_q.QSettings()
    ids, weights = sparse_q.build(probs, settings)
    first = sparse_q._FIRST_TOP
    monkeypatch.setattr(sparse_q, "_FIRST_TOP", settings.max_tokens)  # one full selection for every row
    full_ids, full_weights = sparse_q.build(probs, settings)
    assert torch.equal(ids, full_ids) and torch.equal(weights, full_weights)
    widths = (weights > 0).sum(-1)
    assert widths.min() < first < widths.max()  # both paths ran


# ---- the host selection (issue 29): the same q as a full top-k -------------------------------


def _rows() -> dict[str, torch.Tensor]:
    """Rows [A, V] from sharp to flat, and the awkward ones: ties, zeros, tiny V, a flat tail."""
    g = torch.Generator().manual_seed(29)
    scales = torch.tensor([16.0, 8.0, 4.0, 2.0, 1.0, 0.5, 0.1])[:, None]
    ties = torch.zeros(3, 3000)
    ties[0, :50], ties[1, :2000], ties[2, ::3] = 1.0, 1.0, 1.0  # equal values across a cut and the budget
    zipf = 1.0 / torch.arange(1, 32001, dtype=F64) ** 1.05  # a heavy tail: the budget binds
    return {
        "softmax": torch.softmax(torch.randn(7, 5000, generator=g) * scales, -1),
        "ties": ties / ties.sum(-1, keepdim=True),
        "one-hot and uniform": torch.stack([torch.eye(400)[7], torch.full((400,), 1 / 400)]),
        "tiny V": torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]),
        "zipf tail": (zipf / zipf.sum())[None].to(F32),
        "subnormal tail": torch.cat([torch.tensor([[1.0]]), torch.full((1, 999), 1e-44)], -1),
    }


SETTINGS = [QSettings(), QSettings.top_k(7), QSettings(0.3, 32, 10), QSettings(1e-3, 1792, 2), QSettings(0.0, 4096)]


def _assert_same_q(
    probs: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
):
    """Equal weights slot for slot; equal ids except where equal probabilities trade places (ties)."""
    (ids, w), (ref_ids, ref_w) = got, want
    assert torch.equal(w, ref_w)
    moved = ids != ref_ids
    assert torch.equal(probs.gather(-1, ids)[moved], probs.gather(-1, ref_ids)[moved])


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("name", list(_rows()))
def test_build_equals_the_full_top_k_reference(name: str, settings: QSettings) -> None:
    probs = _rows()[name]
    _assert_same_q(probs, sparse_q.build(probs, settings), reference.build(probs, settings))


def test_the_device_path_equals_the_host_path() -> None:
    # float64 rows (and any row off the host) take torch.topk: the partial-first selection, then the full one.
    probs = _rows()["softmax"]
    for settings in SETTINGS:
        _assert_same_q(probs, sparse_q.build(probs.double(), settings), sparse_q.build(probs, settings))


def test_rows_the_histogram_cannot_decide_take_the_full_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = _rows()["softmax"]
    want = reference.build(probs, QSettings())
    a = probs.numpy()
    total = probs.sum(-1, dtype=F64).numpy()
    assert sparse_q._select_host(np.array([0.5, -0.1, 0.6], dtype=np.float32), 1.0, 8, 1e-3) is None  # negative
    assert sparse_q._select_host(a[0], math.nan, 8, 1e-3) is None
    # Candidates allowed to leave out far more than epsilon: some rows fall short of the mass rule.
    monkeypatch.setattr(sparse_q, "_COVER", 500.0)
    declined = [i for i in range(len(a)) if sparse_q._select_host(a[i], float(total[i]), 1792, 1e-3) is None]
    assert 0 < len(declined) < len(a)
    _assert_same_q(probs, sparse_q.build(probs, QSettings()), want)


def test_sample_slots_equals_sample_sparse() -> None:
    g = torch.Generator().manual_seed(3)
    weights = torch.randint(0, 50, (200, 30), generator=g).float() * (torch.rand(200, 30, generator=g) > 0.4)
    weights[:, 3] += 1  # every row has mass
    ids = torch.randint(0, 1000, (200, 30), generator=g)
    u = torch.rand(200, dtype=F64, generator=g)
    u[:3] = torch.tensor([0.0, 1 - 2**-53, 0.5])
    slot = torch.from_numpy(sparse_q.sample_slots(weights.numpy(), u.numpy()))
    assert torch.equal(ids.gather(-1, slot[:, None])[:, 0], sampler.sample_sparse(ids, weights, u))
