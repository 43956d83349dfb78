"""An emulated accelerator: model services whose model is an exact, cheap function with modelled timing.

Selected like any model (``--model sim:PROFILE``): the real servicers,
batching, sessions, KV budget, rollback and rejection sampler run; only the
model is emulated (`SimRunner`). See docs/performance.md.
"""

from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.lm import SimLM, SimShape
from specd.core.model.sim.profile import (
    EMULATED,
    SIM_PREFIX,
    SimProfile,
    is_sim,
    list_profiles,
    load_profile,
    parse_sim_spec,
)
from specd.core.model.sim.sim_runner import SimRunner, SimStats

__all__ = [
    "EMULATED",
    "SIM_PREFIX",
    "CostModel",
    "SimLM",
    "SimProfile",
    "SimRunner",
    "SimShape",
    "SimStats",
    "is_sim",
    "list_profiles",
    "load_profile",
    "parse_sim_spec",
]
