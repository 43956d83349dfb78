"""Auto over scripted ports (tests/loop_fakes.py): the pipeline and K chosen per round, the
confidence cut and a caller's seed, each giving the greedy fake target's own chain."""

from __future__ import annotations

import itertools

import pytest

from specd.core.errors import Unavailable
from specd.core.rounds.auto import Arm, ArmCycles, AutoChooser, AutoSettings
from specd.core.rounds.generation import FinishReason
from specd.core.rounds.pipeline import PIPELINES
from specd.core.sampling.sampler import SamplingParams
from tests.loop_fakes import FakeDraft, FakeTarget, Script, target_next
from tests.unit.core.rounds.test_loop import PROMPT, check_records, expected, run, spec

SWITCH = 3  # test_a_pre_draft_shorter_...: the round auto moves from bonus-match 3 to 4


@pytest.mark.parametrize("speculation", ["fixed", "auto"])
def test_the_auto_pipeline_tries_the_strategies_and_stays_exact(speculation: str) -> None:
    """pipeline "auto" switches strategy (and, with auto speculation, K) between rounds of one request."""
    target, draft = FakeTarget(), FakeDraft()
    r, records, loop = run(spec(400, pipeline="auto", speculation=speculation, draft_length=4), target, draft)
    assert r.generation.generated == expected(400) and r.finish_reason == FinishReason.LENGTH
    assert target.violations == []  # a strategy switch never verifies a pre-draft made for another prefix
    check_records(r, records)
    ran = {rec.pipeline for rec in records}
    assert len(ran) >= 2 and ran <= set(PIPELINES), ran  # the strategy changed within the request
    assert r.stats.pipeline_hits > 0
    lengths = {rec.draft_length for rec in records[:-2]}
    assert lengths == {4} if speculation == "fixed" else len(lengths) > 1
    cls = loop.auto.workload(greedy=True, running=1)
    assert cls.verify_ms.mean() is not None and cls.residual_ms  # the loop fed auto its cycles and calls
    assert len(cls.arm_residual_ms) >= 2 and {a.pipeline for a in cls.arm_residual_ms if a.k} <= ran  # per arm too
    # ... with the hits its pipelines measured (the loop reported none, so auto read the cache's hit
    # chance on a rejection as 0: 0.67 at 2 of 4 accepted, emulated h100-8b, agreement 0.95, speccache-4) ...
    assert any(e.value > 0 for (pipeline, _), e in cls.hits.items() if pipeline in ran)
    # ... and each pipeline's pre-draft calls, as they answered beside the verify
    assert cls.pre_draft_excess_ms and set(cls.pre_draft_excess_ms) <= ran - {"off"}


def test_auto_cuts_proposals_by_their_confidence_and_stays_exact() -> None:
    """Proposals that say how sure they are: auto learns what that means and verifies a prefix of each."""
    target, draft = FakeTarget(), FakeDraft(confidence=(0.99, 0.9, 0.2, 0.1))
    r, records, loop = run(spec(300, speculation="auto", pipeline="off", draft_length=4), target, draft)
    assert r.generation.generated == expected(300) and target.violations == []
    check_records(r, records)
    assert all(rec.draft_tokens <= rec.draft_length for rec in records)
    cls = loop.auto.workload(greedy=True, running=1)
    assert sum(cls.calibration.reached) > 0  # the verdicts calibrated the confidences


def test_a_caller_seeded_auto_request_keeps_its_draft_length_so_the_output_reproduces() -> None:
    """Which positions are drafted depends on K; auto's K follows timings, so a chosen seed pins it."""
    target, draft = FakeTarget(), FakeDraft(confidence=(0.99, 0.9, 0.2, 0.1))
    s = spec(300, speculation="auto", pipeline="auto", draft_length=4, seeded=True)
    r, records, _ = run(s, target, draft)
    assert r.generation.generated == expected(300) and target.violations == []
    check_records(r, records)
    done = list(itertools.accumulate(len(rec.committed) for rec in records))
    early = [rec for rec, n in zip(records, done) if n <= 300 - 8]  # not yet short of room for K
    assert {rec.draft_length for rec in early} == {4} and all(rec.draft_tokens == 4 for rec in early)  # never cut
    assert len({rec.pipeline for rec in records}) >= 2  # the pipeline is still auto's


def test_a_staged_window_is_cut_as_auto_would_and_the_next_round_verifies_exactly_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Staging with auto: a pre-draft is staged as the next round would verify it (its budget and auto's
    confidence cut applied then), and that round verifies exactly the staged window, the target's staged
    verdict with it: nothing the target ran is thrown away, and the output stays the target's own chain."""
    monkeypatch.setattr(AutoChooser, "cut", lambda self, cls, arm, confidence: 1)  # every proposal: one token
    target = FakeTarget(Script(latency_s=0.02))  # the verify is the slow side: pre-drafts are staged
    draft = FakeDraft(confidence=(0.99, 0.9, 0.2, 0.1))
    # auto's K and cut over a staging pipeline (with --pipeline auto a free fake draft leaves auto no
    # reason to pipeline, and only an exploration round might stage)
    r, records, _ = run(spec(200, speculation="auto", pipeline="spec-cache", draft_length=4), target, draft)
    assert r.generation.generated == expected(200) and target.violations == []
    check_records(r, records)
    assert target.stages and all(len(c.proposal) == 1 for st in target.stages for c in st.candidates)
    assert all(rec.draft_tokens <= 1 for rec in records)
    assert any(rec.staged for rec in records) and target.staged_runs >= sum(rec.staged for rec in records)


@pytest.mark.alone  # auto rates arms from measured walls: a neighbour's load moves where it recovers
def test_a_greedy_request_explores_from_target_only_by_shadow_guesses_and_comes_back_on_them() -> None:
    """A greedy request that stopped drafting explores by shadow guesses: target-only rounds with the
    draft's next token asked beside the verify, its match with the committed token a K = 1 verdict. A
    draft wrong for the first 250 tokens and right after: no drafting round once drafting is ruled out
    (bar an exploration or two, below), guesses meanwhile, and drafting again after the draft turns
    right (which only guesses compared with the right committed position can show; a right guess makes
    the next round a drafting exploration).
    Here that was from token 729 (a 1 ms target); with drafting explorations instead of guesses, 800.
    Auto rates arms from measured walls: with a 1 ms target a loaded host's event-loop delays made
    drafting look dear (a CI run was still target-only at 800, one under three processes on two cores
    to the end), so the target takes 2 ms here (the last target-only round at token 753-828 under the
    same load; at 4 ms a cheap-looking draft is still probed while wrong), the check is from 900, and
    an exploration round or two either way is allowed. The output is the target's own chain throughout."""

    def step(prefix: list[int]) -> int:
        right = target_next(prefix)
        return right if len(prefix) >= len(PROMPT) + 250 else (right + 1) % 61

    draft = FakeDraft(step=step)
    target = FakeTarget(Script(latency_s=0.002))
    r, records, _ = run(spec(1100, speculation="auto", pipeline="off", draft_length=4), target, draft)
    assert r.generation.generated == expected(1100)
    check_records(r, records)
    done = list(itertools.accumulate(len(rec.committed) for rec in records))
    wrong = [rec for rec, n in zip(records, done) if 80 <= n < 250]
    drafting = sum(1 for rec in records if rec.draft_tokens)
    # ruled out: no drafting round bar an exploration or two (auto's costs are measured walls)
    assert wrong and sum(1 for rec in wrong if rec.draft_tokens) <= 2
    assert len(draft.prefixes) > drafting  # ... but guesses beside target-only rounds
    right = [rec for rec, n in zip(records, done) if n >= 900]
    assert right and sum(1 for rec in right if rec.draft_tokens) >= 0.9 * len(right)  # drafting again


def test_a_sampled_request_explores_from_target_only_by_shadow_guesses_at_the_targets_coin() -> None:
    """At T > 0 too, a request that stopped drafting explores by shadow guesses, drawn at the target's coin
    (the propose's guess_bonus): a target-only round's token is a bonus, so bonus-match's guess is the
    draft's best guess of it. A draft wrong throughout: once the first rounds have ruled drafting out, no
    drafting round, and guesses instead (probes, and one exploration every explore_target_only_every
    rounds). Before, a sampled request explored
    by drafting (about 7 K = 1 rounds here, each waiting for its draft). The output is the target's chain."""

    def step(prefix: list[int]) -> int:
        return (target_next(prefix) + 1) % 61

    draft = FakeDraft(step=step)
    target = FakeTarget(Script(latency_s=0.002))
    sampled = SamplingParams(temperature=0.7, seed=1)
    r, records, _ = run(spec(600, speculation="auto", pipeline="off", draft_length=4, params=sampled), target, draft)
    assert r.generation.generated == expected(600)
    check_records(r, records)
    done = list(itertools.accumulate(len(rec.committed) for rec in records))
    late = [rec for rec, n in zip(records, done) if n >= 80]
    assert late and sum(1 for rec in late if rec.draft_tokens) <= 2  # ruled out: an exploration or two at most
    guesses = sum(draft.guess_flags)  # the shadow guesses: the only proposes that guess the bonus here
    assert guesses >= 500 // AutoSettings().explore_target_only_every - 1
    assert len(draft.prefixes) == guesses + sum(1 for rec in records if rec.draft_tokens)


def test_auto_fits_no_draft_cost_from_a_requests_opening_round() -> None:
    """A request's first draft call carries the draft's prefill (here 300 ms more). Fitted, it made the
    draft's hops 300 ms where every later call took ~1 ms, so every miss and every round without a
    pipeline looked dearer. Its verdict counts. (The opening verify stays in v(n): docs/performance.md.)"""
    target, draft = FakeTarget(), FakeDraft(Script(slow={1: 0.3}))
    r, records, loop = run(spec(40, speculation="auto", pipeline="off", draft_length=2), target, draft)
    assert r.generation.generated == expected(40) and records[0].draft_tokens > 0
    assert records[0].wall_ms > 300.0  # the opening round was the slow one
    cls = loop.auto.workload(greedy=True, running=1)
    assert cls.draft_hops_ms.value < 5.0
    assert all(abs(e.value) < 5.0 for e in cls.residual_ms.values())
    assert cls.acceptance.verdicts >= sum(rec.draft_tokens > 0 for rec in records)  # the first verdict too


def test_no_cycle_auto_measures_holds_the_opening_rounds_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opening round's verify carries the target's prefill (here 300 ms more): its cycle (its verify
    out to the next round's) goes to no arm's excess, every later round's does."""
    cycles: list[float] = []
    observe = AutoChooser.observe_cycle

    def spy(
        self: AutoChooser, cls: ArmCycles, arm: Arm, cycle_ms: float, hit: bool = False, all_in: bool = False
    ) -> None:
        cycles.append(cycle_ms)
        observe(self, cls, arm, cycle_ms, hit, all_in)

    monkeypatch.setattr(AutoChooser, "observe_cycle", spy)
    target = FakeTarget(Script(slow={1: 0.3}))
    r, records, _ = run(spec(40, speculation="auto", pipeline="off", draft_length=2), target, FakeDraft())
    assert r.generation.generated == expected(40) and records[0].wall_ms > 300.0
    assert len(cycles) >= len(records) // 2 and max(cycles) < 100.0


def test_auto_fits_no_cost_from_the_first_draft_call_after_target_only_rounds() -> None:
    """The first draft call that answers opens the draft's session: its wall carries the prefill of
    everything committed so far (here 300 ms more), not a draft's cost, and neither does the cycle
    that waited for it."""
    target = FakeTarget()
    draft = FakeDraft(Script(fail={1: Unavailable("draft restarting")}, slow={2: 0.3}))
    r, records, loop = run(spec(40, speculation="auto", pipeline="off", draft_length=2), target, draft)
    assert r.generation.generated == expected(40)
    assert records[0].draft_tokens == 0 and any(rec.wall_ms > 300.0 for rec in records[1:])
    cls = loop.auto.workload(greedy=True, running=1)
    assert cls.draft_hops_ms.value < 5.0
    assert all(abs(e.value) < 5.0 for e in cls.residual_ms.values())


def test_a_pre_draft_shorter_than_the_next_arms_k_is_that_rounds_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that verifies a pre-draft made for a shorter arm (K = 3, then bonus-match 4) verifies that
    window: its K is the window's, so bonus-match pre-drafts after it (a full proposal of that K), and
    no cycle of the arm is measured from it. Before, it asked for 4, could not pre-draft after 3, and its
    next round's fresh draft was measured as bonus-match 4 missing with every draft accepted."""
    chosen: list[Arm] = []

    def choose(self: AutoChooser, cls: ArmCycles) -> Arm:
        chosen.append(Arm("bonus-match", 3 if len(chosen) < SWITCH else 4))
        return chosen[-1]

    observed: list[int] = []  # the round whose start measured a cycle (its previous round's)
    observe = AutoChooser.observe_cycle

    def spy(self: AutoChooser, cls: ArmCycles, arm: Arm, cycle_ms: float, hit: bool = False, all_in: bool = False):
        observed.append(len(chosen) - 1)
        observe(self, cls, arm, cycle_ms, hit, all_in)

    monkeypatch.setattr(AutoChooser, "choose", choose)
    monkeypatch.setattr(AutoChooser, "observe_cycle", spy)
    r, records, _ = run(spec(60, speculation="auto", pipeline="auto"), FakeTarget(), FakeDraft())
    assert r.generation.generated == expected(60)
    check_records(r, records)
    switch = records[SWITCH]  # the first bonus-match 4 round: the K = 3 round before it hit
    assert records[SWITCH - 1].accepted == 3 and switch.pipeline_hit is not None
    assert switch.draft_length == 3 and switch.pipeline_launched == 1
    assert SWITCH + 1 not in observed and SWITCH + 2 in observed  # its cycle is not the arm's; the next is
