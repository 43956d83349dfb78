"""`specd bench --sim PROFILE`: the bench on emulated accelerators (specd.core.model.sim).

Both model services run `--model sim:PROFILE` (the real servicers, batching,
sessions and sampler; only the model is emulated), so the bench measures the
system's own speed in the regime it is built for. The cost ratio c and the
target's K+1-token verify time come from the profile's cost model (there is
no real model to time in-process), and every table and plot says "emulated".
"""

from __future__ import annotations

import argparse
from typing import Any

from specd.core.model.sim import EMULATED, SIM_PREFIX, SimProfile, list_profiles, parse_sim_spec

SIM_MODES = "target-only,fixed,pipelined,postverify,speccache,auto"  # the default modes on an emulator (no in-process HF baseline)


def sim_spec(text: str) -> str:
    """'PROFILE[,key=value...]' or 'sim:...' -> the model setting both services get."""
    return text if text.startswith(SIM_PREFIX) else SIM_PREFIX + text


def apply_sim(args: argparse.Namespace, default_modes: str) -> SimProfile:
    """Point the run at the emulated pair: both services' --model, one torch thread each, no HF baseline."""
    profile = parse_sim_spec(sim_spec(args.sim))  # InvalidArgument names the shipped profiles
    args.target = args.draft = profile.spec
    args.target_threads = args.draft_threads = 1  # the emulated models' host work is small tensors
    args.no_inprocess = True  # nothing to load in-process: c comes from the cost model
    if args.modes == default_modes:
        args.modes = SIM_MODES
    return profile


def sim_cost(profile: SimProfile, prompt_tokens: int, draft_lengths: list[int]) -> dict[str, Any]:
    """c and the verify times from the profile's cost model, one session at the prompt's length.

    Same keys as the in-process measurement (specd.tools.bench.cost.measure_cost).
    """
    target, draft = profile.cost("target"), profile.cost("draft")
    n = max(1, prompt_tokens)
    target_ms = target.forward_ms([1], [n])
    draft_ms = draft.forward_ms([1], [n])
    return {
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "c": draft_ms / target_ms if target_ms > 0 else None,
        "target_verify_ms": {str(k): target.forward_ms([k + 1], [n + k]) for k in sorted(set(draft_lengths))},
        "target_threads": 1,
        "draft_threads": 1,
        "samples": 0,
        "source": f"cost model of the profile {profile.spec} ({EMULATED})",
    }


def sim_meta(profile: SimProfile) -> dict[str, Any]:
    """What the report says about the emulated pair (meta.emulated)."""
    return {
        "label": EMULATED,
        "profile": profile.name,
        "spec": profile.spec,
        "description": profile.description,
        "agreement": profile.agreement,
        "vocab_size": profile.vocab_size,
        "time_scale": profile.time_scale,
        "target": {
            "model": profile.target.model,
            "hardware": profile.target.hardware,
            "cost": vars(profile.cost("target")),
        },
        "draft": {
            "model": profile.draft.model,
            "hardware": profile.draft.hardware,
            "cost": vars(profile.cost("draft")),
        },
        "sources": [s.get("url") for s in profile.sources],
    }


def print_profiles() -> int:
    """`specd bench --list-sim-profiles`: the shipped profile names, one per line."""
    for name in list_profiles():
        print(name)
    return 0
