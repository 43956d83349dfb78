"""Emulated-accelerator profiles: which model pair, on which hardware, with which sources.

A profile is a JSON file (shipped ones live in specd/core/model/sim/profiles/):

    name, description
    vocab_size, max_context          the emulated token space and context
    shape                            SimShape fields: how peaked p is (lm.py)
    agreement                        the draft's default agreement with the target (acceptance knob)
    target, draft                    each: model, hardware, kv_bytes_per_token, cost (CostModel fields)
    measured                         optional: figures measured on real hardware that the
                                     emulator must reproduce (the demo pair's round at K=4)
    sources                          where every number came from

A model setting selects one: ``sim:NAME`` (a shipped profile) or
``sim:PATH.json``, optionally followed by overrides, comma-separated:

    sim:h100-70b-tp2,agreement=0.7,time_scale=0.5,vocab_size=4096

agreement (the draft's q against p), time_scale (every cost term times
this; 0 = no waiting), vocab_size (a smaller token space: cheaper host-side
sampling, less realistic), seed (another emulated model). The target and
the draft must be given the same profile (and vocab_size/seed) so that
they agree on p; agreement only changes the draft.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.core.errors import InvalidArgument
from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.lm import SimLM, SimShape
from specd.core.model.sim.sim_runner import SimRunner

__all__ = [
    "EMULATED",
    "PROFILES_DIR",
    "SIM_PREFIX",
    "DeviceProfile",
    "SimProfile",
    "is_sim",
    "list_profiles",
    "load_profile",
    "parse_sim_spec",
]

SIM_PREFIX = "sim:"
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
EMULATED = "emulated"  # the label every table and plot made on a profile carries
_OVERRIDES = {"agreement": float, "time_scale": float, "vocab_size": int, "seed": int}


@dataclass(frozen=True)
class DeviceProfile:
    """One side (target or draft): the model it stands for, its hardware, and its cost model."""

    model: str
    hardware: str
    cost: CostModel
    kv_bytes_per_token: int = 0

    @staticmethod
    def from_dict(data: dict[str, Any], where: str) -> DeviceProfile:
        try:
            return DeviceProfile(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                cost=CostModel.from_dict(dict(data["cost"])),
                kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
            )
        except KeyError as e:
            raise InvalidArgument(f"profile {where} needs the field {e.args[0]!r}") from None


@dataclass(frozen=True)
class SimProfile:
    name: str
    description: str
    max_context: int
    shape: SimShape
    agreement: float
    target: DeviceProfile
    draft: DeviceProfile
    time_scale: float = 1.0
    measured: dict[str, Any] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # applied by with_overrides (part of `spec`)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def label(self) -> str:
        """How tables and plots name it: always says emulated."""
        return f"{self.name} ({EMULATED})"

    @property
    def spec(self) -> str:
        """The model setting that selects this profile with its overrides (what both services get)."""
        source = self.name if self.path is None or self.path.parent == PROFILES_DIR else str(self.path)
        return f"{SIM_PREFIX}{source}" + "".join(f",{k}={v}" for k, v in sorted(self.overrides.items()))

    def cost(self, role: str) -> CostModel:
        return self._side(role).cost.scaled(self.time_scale)

    def runner(self, role: str, **kwargs: Any) -> SimRunner:
        """A SimRunner for the target (p) or the draft (q at this profile's agreement)."""
        side = self._side(role)
        lm = SimLM(self.shape, None if role == "target" else self.agreement)
        return SimRunner(
            lm, self.cost(role), max_context=self.max_context, kv_bytes_per_token=side.kv_bytes_per_token, **kwargs
        )

    def _side(self, role: str) -> DeviceProfile:
        if role == "target":
            return self.target
        if role == "draft":
            return self.draft
        raise InvalidArgument(f"role must be 'target' or 'draft', got {role!r}")

    def with_overrides(self, **overrides: Any) -> SimProfile:
        unknown = sorted(set(overrides) - set(_OVERRIDES))
        if unknown:
            raise InvalidArgument(f"unknown profile overrides {unknown}; known: {sorted(_OVERRIDES)}")
        shape = self.shape
        if "vocab_size" in overrides:
            shape = dataclasses.replace(shape, vocab_size=int(overrides["vocab_size"]))
        if "seed" in overrides:
            shape = dataclasses.replace(shape, seed=int(overrides["seed"]))
        out = dataclasses.replace(
            self,
            shape=shape,
            agreement=float(overrides.get("agreement", self.agreement)),
            time_scale=float(overrides.get("time_scale", self.time_scale)),
            overrides={**self.overrides, **overrides},
        )
        out.validate()
        return out

    def validate(self) -> None:
        if not 0.0 <= self.agreement <= 1.0:
            raise InvalidArgument(f"agreement must be in [0, 1], got {self.agreement}")
        if self.time_scale < 0:
            raise InvalidArgument(f"time_scale must be >= 0, got {self.time_scale}")
        if self.max_context < 2:
            raise InvalidArgument(f"max_context must be >= 2, got {self.max_context}")
        if self.vocab_size < 259:
            raise InvalidArgument(f"vocab_size must be >= 259 (bytes + specials), got {self.vocab_size}")

    @staticmethod
    def from_dict(data: dict[str, Any], path: Path | None = None) -> SimProfile:
        where = str(path) if path else data.get("name", "?")
        known = {
            "name",
            "description",
            "vocab_size",
            "max_context",
            "shape",
            "agreement",
            "target",
            "draft",
            "measured",
            "sources",
            "notes",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"profile {where}: unknown fields {unknown}; known: {sorted(known)}")
        try:
            shape = SimShape.from_dict({**data.get("shape", {}), "vocab_size": int(data["vocab_size"])})
            profile = SimProfile(
                name=str(data["name"]),
                description=str(data.get("description", "")),
                max_context=int(data["max_context"]),
                shape=shape,
                agreement=float(data["agreement"]),
                target=DeviceProfile.from_dict(data["target"], f"{where} target"),
                draft=DeviceProfile.from_dict(data["draft"], f"{where} draft"),
                measured=dict(data.get("measured", {})),
                sources=list(data.get("sources", [])),
                path=path,
            )
        except KeyError as e:
            raise InvalidArgument(f"profile {where} needs the field {e.args[0]!r}") from None
        profile.validate()
        return profile


def is_sim(spec: str) -> bool:
    """Does a model setting name an emulated model (sim:...)?"""
    return isinstance(spec, str) and spec.startswith(SIM_PREFIX)


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> SimProfile:
    """A shipped profile by name, or a profile file by path."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".json") or "/" in name_or_path):
        path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise InvalidArgument(
                f"unknown emulated-accelerator profile {name_or_path!r}; shipped: {', '.join(list_profiles())} "
                "(or pass sim:PATH.json)"
            )
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InvalidArgument(f"cannot read the profile file {str(path)!r}: {e}") from e
    except ValueError as e:
        raise InvalidArgument(f"the profile file {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidArgument(f"the profile file {str(path)!r} must hold a JSON object")
    return SimProfile.from_dict(data, path)


def parse_sim_spec(spec: str) -> SimProfile:
    """'sim:NAME[,key=value...]' -> the profile with its overrides applied."""
    if not is_sim(spec):
        raise InvalidArgument(f"{spec!r} is not an emulated model; use sim:PROFILE")
    name, *parts = spec[len(SIM_PREFIX) :].split(",")
    if not name:
        raise InvalidArgument(f"{spec!r} names no profile; use sim:PROFILE (shipped: {', '.join(list_profiles())})")
    overrides: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _OVERRIDES:
            raise InvalidArgument(
                f"{spec!r}: override {part!r} must be key=value with key one of {', '.join(sorted(_OVERRIDES))}"
            )
        try:
            overrides[key] = _OVERRIDES[key](value.strip())
        except ValueError:
            raise InvalidArgument(f"{spec!r}: {key} must be a {_OVERRIDES[key].__name__}, got {value!r}") from None
    return load_profile(name).with_overrides(**overrides)
