"""The emulated demo pair (profile cpu-demo-pair) takes the round time measured on the real pair.

Its rounds wait out the modelled time (seconds in all), so it is here, not in tests/unit/core/model/sim/test_sim.py.
"""

from __future__ import annotations

import random
import statistics
import time

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model.sim import load_profile
from specd.core.rounds.steps import ProposeRequest, VerifyRequest
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier


def test_demo_profile_reproduces_the_measured_round_at_k4():
    """The emulated demo pair's K=4 round (real drafter + verifier + sampler, emulated models) takes the
    round time measured on the real pair (the figures recorded in the profile) within 10%."""
    profile = load_profile("cpu-demo-pair")
    m = profile.measured
    assert m.get("k") == 4 and m.get("round_ms_p50", 0) > 0, "the profile records no measurement"
    verifier = Verifier(profile.runner("target"))
    drafter = ModelDrafter(profile.runner("draft"))
    rng = random.Random(6)
    params = SamplingParams(temperature=0.0)
    rounds: list[float] = []
    # One prompt of the measured length, fewer tokens than measured: the median round is the steady
    # state either way (the first round, with the prefill, is one of many).
    for i, length in enumerate(m["prompt_lengths"][:1]):
        prompt = [rng.randrange(256) for _ in range(length)]
        sid = f"demo-{i}"
        verifier.open(sid, prompt, params)
        drafter.open(sid, prompt, params)
        committed, known = list(prompt), len(prompt)
        while len(committed) - len(prompt) < min(12, m["new_tokens"]):
            t0 = time.perf_counter()
            proposal = drafter.propose(ProposeRequest(sid, len(committed), known, committed[known:], 4))
            outcome = verifier.verify(VerifyRequest(sid, len(committed), proposal))
            rounds.append((time.perf_counter() - t0) * 1e3)
            known = len(committed) + outcome.accepted
            committed += proposal.token_ids[: outcome.accepted] + [outcome.token_id]
        verifier.close(sid)
        drafter.close(sid)
    emulated = statistics.median(rounds)
    assert abs(emulated / m["round_ms_p50"] - 1) <= 0.10, f"emulated {emulated:.1f} ms, measured {m['round_ms_p50']}"
