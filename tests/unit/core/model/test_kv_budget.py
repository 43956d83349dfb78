"""The KV budget holds while sessions grow: a step that does not fit sheds its own session, nobody else's.

Two sessions whose prompts fit the budget but whose growth does not: the
older one grows on and produces exactly what it produces alone; the younger
one is shed with ResourceExhausted once its step no longer fits (whatever
its place in the batch), an idle session is never touched, and the bytes the
caches hold (measured right after every forward, the step's peak) never
exceed the budget. The same for the model drafter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from torch import Tensor
from transformers import PreTrainedModel

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.errors import ResourceExhausted, SessionNotFound
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.rounds.steps import ProposeRequest, VerifyOutcome, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0, seed=1)
ROUNDS = 6
OLD_K, YOUNG_K = 2, 6  # draft tokens per round: the young session asks for more


class WatchedRunner(CausalLMRunner):
    """A real runner that reads the engine's KV bytes right after every forward (a step's peak)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        self.watch: Callable[[], int] | None = None
        self.peaks: list[int] = []

    def logits_batch(
        self, sessions: Sequence[KVSession], num_last: Sequence[int], *, beside: Callable[[], None] | None = None
    ) -> list[Tensor]:
        out = super().logits_batch(sessions, num_last, beside=beside)
        if self.watch is not None:
            self.peaks.append(self.watch())
        return out


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    prompts = {name: t.tokenizer(text).input_ids for name, text in PROMPTS.items()}
    return t.model, d.model, prompts


PROMPTS = {"old": "the older request", "idle": "an idle one", "young": "a younger request"}


def _budget_tokens(prompts: dict[str, list[int]]) -> int:
    """Room for every prompt, all of the old session's growth, and a few rounds of the young one's.

    Round r (from 0) needs the old session at len + 3r + 3 (2 drafts all accepted, then the bonus)
    and the young one at len + r + 7 (6 drafts, none accepted, then the recovered token): both fit
    while 4r + 10 <= 22, so the young session's round 4 is the first that does not.
    """
    return sum(len(p) for p in prompts.values()) + (OLD_K + 1) * ROUNDS + 4


E = TypeVar("E", Verifier, ModelDrafter)


def _opened(engine: E, name: str, prompts: dict[str, list[int]]) -> E:
    engine.open(name, prompts[name], GREEDY)
    return engine


# ---- the verifier ---------------------------------------------------------------------------------


def _old_drafts(greedy: list[int], committed: int) -> list[int]:
    """The old session's drafts: the target's own greedy continuation (all accepted, then the bonus)."""
    return greedy[committed : committed + OLD_K]


def _young_drafts(r: int) -> list[int]:
    """Tokens the tiny target never picks in a row: nothing accepted, one recovered token per round."""
    return [(40 + 3 * r + j) % 190 for j in range(YOUNG_K)]


def _greedy_continuation(runner: CausalLMRunner, prompt: list[int], n: int) -> list[int]:
    s = runner.new_session(prompt)
    for _ in range(n):
        runner.append(s, [int(runner.logits(s, 1)[-1].argmax())])
    return s.tokens


def _verify_rounds(v: Verifier, names: Sequence[str], prompts: dict[str, list[int]], greedy: list[int]):
    """ROUNDS batched verifies of `names` (in this batch order); per round, per name, the outcome or error."""
    committed = {n: len(prompts[n]) for n in names}
    history: list[dict[str, VerifyOutcome | Exception]] = []
    live = list(names)
    for r in range(ROUNDS):
        reqs = [
            VerifyRequest(
                n, committed[n], Proposal(_old_drafts(greedy, committed[n]) if n == "old" else _young_drafts(r))
            )
            for n in live
        ]
        results = dict(zip(live, v.verify_batch(reqs)))
        history.append(results)
        for n, res in results.items():
            if isinstance(res, VerifyOutcome):
                committed[n] = res.committed_length
            else:
                live.remove(n)  # the coordinator fails that request (RESOURCE_EXHAUSTED) and closes it
                v.close(n)
    return history


def test_a_session_that_outgrows_the_budget_is_shed_alone_in_a_verify_batch(models) -> None:
    target, _, prompts = models
    runner = WatchedRunner(target)
    greedy = _greedy_continuation(runner, prompts["old"], (OLD_K + 1) * ROUNDS + OLD_K)
    alone = {
        n: [h[n] for h in _verify_rounds(_opened(Verifier(runner), n, prompts), [n], prompts, greedy)]
        for n in ("old", "young")
    }
    assert all(isinstance(o, VerifyOutcome) for o in alone["old"] + alone["young"])
    assert [o.accepted for o in alone["old"]] == [OLD_K] * ROUNDS  # it really grows by 3 a round

    budget = runner.kv_bytes_per_token * _budget_tokens(prompts)
    v = Verifier(runner, max_kv_bytes=budget)
    for n in ("old", "idle", "young"):  # open order is age: "young" opened last
        v.open(n, prompts[n], GREEDY)
    runner.watch, runner.peaks = v.kv_bytes, []
    history = _verify_rounds(v, ["young", "old"], prompts, greedy)  # the young one first in the batch

    got_old = [h["old"] for h in history]
    assert all(isinstance(o, VerifyOutcome) for o in got_old), got_old
    assert [(o.accepted, o.token_id, o.committed_length) for o in got_old] == [
        (o.accepted, o.token_id, o.committed_length) for o in alone["old"]
    ]
    young = [h["young"] for h in history if "young" in h]
    assert len(young) == 5 and all(isinstance(o, VerifyOutcome) for o in young[:4]), young  # rounds 0-3 fit
    assert [o.token_id for o in young[:4]] == [o.token_id for o in alone["young"][:4]]
    shed = young[4]
    assert isinstance(shed, ResourceExhausted), shed
    assert "KV-cache budget" in str(shed) and str(budget) in str(shed) and "--max-kv-bytes" in str(shed)
    assert "retry" in str(shed).lower()
    assert history[4]["old"].phases.batch_size == 1  # the shed one left the forward
    assert v._pool.get("idle").kv.tokens == prompts["idle"]  # the idle session was never touched
    assert max(runner.peaks) <= budget, (max(runner.peaks), budget)
    assert v.kv_bytes() <= budget


def test_a_shed_verify_keeps_its_session_at_the_committed_prefix(models) -> None:
    target, _, prompts = models
    runner = CausalLMRunner(target)
    p = prompts["young"]
    v = Verifier(runner, max_kv_bytes=runner.kv_bytes_per_token * (len(p) + 3))
    v.open("s", p, GREEDY)
    result = v.verify_batch([VerifyRequest("s", len(p), Proposal([5, 6, 7]))])[0]  # needs len + 4
    assert isinstance(result, ResourceExhausted), result
    assert v._pool.get("s").kv.tokens == p
    ok = v.verify_batch([VerifyRequest("s", len(p), Proposal([5, 6]))])[0]  # len + 3 fits
    assert isinstance(ok, VerifyOutcome), ok


# ---- the model drafter ------------------------------------------------------------------------------


BONUS, RECOVERED = 5, 7  # the verdicts the test plays: old's drafts all accepted + a bonus, young's none


def _propose_rounds(d: ModelDrafter, names: Sequence[str], prompts: dict[str, list[int]]):
    """ROUNDS batched proposes as the coordinator sends them after the verdicts above."""
    seq = {n: list(prompts[n]) for n in names}
    start = {n: len(prompts[n]) for n in names}
    tail: dict[str, list[int]] = {n: [] for n in names}
    history: list[dict[str, Proposal | Exception]] = []
    live = list(names)
    for _ in range(ROUNDS):
        reqs = [ProposeRequest(n, len(seq[n]), start[n], tail[n], OLD_K if n == "old" else YOUNG_K) for n in live]
        results = dict(zip(live, d.propose_batch(reqs)))
        history.append(results)
        for n, res in results.items():
            if not isinstance(res, Proposal):
                live.remove(n)  # the coordinator turns that request target-only: no more draft calls
                continue
            if n == "old":
                start[n], tail[n] = len(seq[n]) + len(res), [BONUS]
                seq[n] += [*res.token_ids, BONUS]
            else:
                start[n], tail[n] = len(seq[n]), [RECOVERED]
                seq[n] += [RECOVERED]
    return history


def test_a_session_that_outgrows_the_budget_is_shed_alone_in_a_draft_batch(models) -> None:
    _, draft, prompts = models
    runner = WatchedRunner(draft)
    alone = {
        n: [h[n] for h in _propose_rounds(_opened(ModelDrafter(runner), n, prompts), [n], prompts)]
        for n in ("old", "young")
    }

    budget = runner.kv_bytes_per_token * _budget_tokens(prompts)
    d = ModelDrafter(runner, max_kv_bytes=budget)
    for n in ("old", "idle", "young"):
        d.open(n, prompts[n], GREEDY)
    runner.watch, runner.peaks = d.kv_bytes, []
    history = _propose_rounds(d, ["young", "old"], prompts)

    got_old = [h["old"] for h in history]
    assert all(isinstance(p, Proposal) for p in got_old), got_old
    assert [p.token_ids for p in got_old] == [p.token_ids for p in alone["old"]]
    young = [h["young"] for h in history if "young" in h]
    assert len(young) == 5 and all(isinstance(p, Proposal) for p in young[:4]), young
    assert [p.token_ids for p in young[:4]] == [p.token_ids for p in alone["young"][:4]]
    assert isinstance(young[4], ResourceExhausted) and "KV-cache budget" in str(young[4]), young[4]
    assert d._pool.get("idle").kv.tokens == prompts["idle"]
    assert max(runner.peaks) <= budget and d.kv_bytes() <= budget


def test_a_sync_that_overflows_the_budget_drops_the_youngest_session_only(models) -> None:
    """Tokens no step was granted (target-only rounds the draft missed) arrive in a sync: the youngest goes."""
    _, draft, prompts = models
    runner = CausalLMRunner(draft)
    old, young = prompts["old"], prompts["young"]
    d = ModelDrafter(runner, max_kv_bytes=runner.kv_bytes_per_token * (len(old) + len(young) + 12))
    d.open("old", old, GREEDY)
    d.open("young", young, GREEDY)
    missed = [RECOVERED] * 13  # 13 target-only rounds: the prefixes alone now need 13 > 12 spare tokens
    results = d.propose_batch(
        [
            ProposeRequest("young", len(young) + len(missed), len(young), missed, 1),
            ProposeRequest("old", len(old), len(old), [], 1),
        ]
    )
    assert isinstance(results[1], Proposal), results[1]
    assert isinstance(results[0], ResourceExhausted) and "dropped" in str(results[0]), results[0]
    with pytest.raises(SessionNotFound):
        d._pool.get("young")  # its memory is back; a later call re-opens it (and is admitted or refused)
    assert d.kv_bytes() <= d._pool.budget.max_bytes
