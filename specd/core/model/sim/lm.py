"""The emulated language model: next-token logits as an exact, cheap function of the context.

The target's p and the draft's q are deterministic functions of the last
`context_tokens` token ids (and nothing else: not the batch, not the call
order, not the process), so a test can recompute p for any context and
check sampled outputs against it.

Shape (per context, "role" = target or the draft's own noise model):

    h        = hash(seed, role, last context_tokens ids)      splitmix64 chain
    head     = `head` token ids at (offset_h + D_m) mod V      D: fixed distinct offsets
    l[v]     = -zipf * ln(1 + head + rank(v))                  background: a fixed Zipf
                                                               "unigram" over a fixed
                                                               random ranking of the vocab
    l[head_m] = -zipf * ln(1 + m) + noise * g_m                g_m: centred Gumbel(h, m)
    logits   = beta_h * l                                      beta_h = sharpness *
                                                               exp(spread * z_h), z_h ~ N(0, 1)

so each context has a few dominant tokens (Zipf-ranked, reordered by the
noise), a long tail carrying a small mass, and its own entropy (beta).

The draft's logits mix the target's with an independent model r of the
same shape (another role in the hash):

    q_logits = a * beta_p * l_p + (1 - a) * beta_r * l_r        a = agreement

a = 1 gives q = p (acceptance 1 at T = 0), a = 0 an unrelated draft;
acceptance falls monotonically in between (docs/performance.md has the
measured curve). Everything is vectorised: numpy uint64 hashing over the
rows asked for, then one [R, V] float32 pass in torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import InvalidArgument

__all__ = ["DRAFT_NOISE_ROLE", "TARGET_ROLE", "SimLM", "SimShape", "mix64", "splitmix_uniforms"]

TARGET_ROLE = 1  # the target's p
DRAFT_NOISE_ROLE = 2  # the draft's independent component r

_MASK = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15  # splitmix64 increment (odd)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MISSING = 0xFFFF_FFFF_FFFF_FFF1  # stands for "no token here" (context shorter than context_tokens)
_EULER_GAMMA = 0.5772156649015329


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over uint64 arrays (array arithmetic wraps modulo 2**64, silently)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _mix_int(z: int) -> int:
    """mix64 of one Python int (the scalar parts, without numpy's scalar overflow warnings)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _slots(count: int) -> np.ndarray:
    """[count] uint64: splitmix_uniforms' slot salts (j + 1) * 3G."""
    return np.array([(j + 1) * 3 * _G & _MASK for j in range(count)], dtype=np.uint64)


def splitmix_uniforms(h: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """[R] uint64 states, [count] slot salts (_slots) -> [R, count] float64 uniforms in (0, 1),
    slot j = mix(h ^ (j + 1) * 3G)."""
    bits = mix64(h[:, None] ^ slots[None, :])
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SimShape:
    """The shape of the emulated distributions (see the module docstring)."""

    vocab_size: int = 32000
    context_tokens: int = 3  # p depends on the last this-many tokens
    head: int = 64  # dominant tokens per context
    zipf: float = 1.1  # rank exponent of head and tail
    noise: float = 1.0  # Gumbel jitter of the head (reorders ranks per context)
    sharpness: float = 1.5  # median inverse temperature of a context
    sharpness_spread: float = 0.5  # log-normal spread of the inverse temperature across contexts
    seed: int = 0  # which emulated model: change it for an unrelated one

    def __post_init__(self) -> None:
        if not 2 <= self.vocab_size <= 1 << 24:
            raise InvalidArgument(f"vocab_size must be in [2, 2**24], got {self.vocab_size}")
        if not 1 <= self.context_tokens <= 64:
            raise InvalidArgument(f"context_tokens must be in [1, 64], got {self.context_tokens}")
        if not 1 <= self.head <= self.vocab_size:
            raise InvalidArgument(f"head must be in [1, vocab_size], got {self.head}")
        for name in ("zipf", "noise", "sharpness", "sharpness_spread"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SimShape:
        known = set(SimShape.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"unknown shape fields {unknown}; known: {sorted(known)}")
        return SimShape(**data)


class SimLM:
    """Logits of the emulated target (agreement None) or of its draft (agreement in [0, 1])."""

    def __init__(self, shape: SimShape, agreement: float | None = None) -> None:
        if agreement is not None and not 0.0 <= agreement <= 1.0:
            raise InvalidArgument(f"agreement must be in [0, 1], got {agreement}")
        self.shape = shape
        self.agreement = agreement
        self.vocab_size = shape.vocab_size
        V, M = shape.vocab_size, shape.head
        ids = np.arange(V, dtype=np.uint64)
        # A fixed ranking of the vocabulary (the background "unigram") and the head's
        # fixed distinct offsets, both from the hash: the same on every machine.
        rank = np.empty(V, dtype=np.int64)
        rank[np.argsort(mix64(ids ^ np.uint64(_mix_int(shape.seed + _G))), kind="stable")] = np.arange(V)
        self.background = torch.from_numpy(
            (-shape.zipf * np.log1p(M + rank.astype(np.float64))).astype(np.float32)
        )  # [V] float32
        order = np.argsort(mix64(ids ^ np.uint64(_mix_int(shape.seed + 2 * _G))), kind="stable")
        self.offsets = torch.from_numpy(order[:M].astype(np.int64))  # [M] distinct in [0, V)
        self.head_base = torch.from_numpy(
            (-shape.zipf * np.log1p(np.arange(M, dtype=np.float64))).astype(np.float32)
        )  # [M]
        self._slots = _slots(M + 2)  # the uniforms' salts: offset, beta, then one per head token

    # ---- the function --------------------------------------------------------

    def _last_ids(self, contexts: Sequence[Sequence[int]]) -> np.ndarray:
        """[R, n] uint64: the last n = context_tokens ids of each context, right-aligned, _MISSING where it is shorter."""
        n = self.shape.context_tokens
        pad = [_MISSING] * n
        return np.array([(pad + [int(t) for t in ctx[-n:]])[-n:] for ctx in contexts], dtype=np.uint64)

    def _hashes(self, last: np.ndarray, roles: Sequence[int]) -> np.ndarray:
        """[G R] uint64: the hash of (seed, role, the row's ids) of each row of `last` [R, n] for each of G
        roles, role by role (one chain of array passes for all: a round's few rows took ~8 us per pass and role)."""
        starts = [_mix_int(self.shape.seed + role * _G) for role in roles]  # G chain starts
        if len(roles) == 1:
            h, rows = np.full(last.shape[0], starts[0], dtype=np.uint64), last  # [R], [R, n]
        else:
            h, rows = np.repeat(np.array(starts, dtype=np.uint64), last.shape[0]), np.tile(last, (len(roles), 1))
        for j in range(last.shape[1]):
            h = mix64(h ^ (rows[:, j] + np.uint64((j + 1) * _G & _MASK)))
        return h

    def components(self, contexts: Sequence[Sequence[int]], role: int) -> tuple[Tensor, Tensor, Tensor]:
        """(beta [R] float32, head ids [R, M] int64, head logits before beta [R, M] float32) of one role."""
        return self._components(self._last_ids(contexts), (role,))[0]

    def _components(self, last: np.ndarray, roles: Sequence[int]) -> list[tuple[Tensor, Tensor, Tensor]]:
        """components of each role for the contexts' last ids [R, n], worked out for all roles in one pass
        (each number is elementwise in its row and role: the same as one role at a time)."""
        V, R = self.shape.vocab_size, last.shape[0]
        u = splitmix_uniforms(self._hashes(last, roles), self._slots)  # [G R, head + 2]
        offset = np.floor(u[:, 0] * V).astype(np.int64)  # [G R]
        z = math.sqrt(2.0) * torch.erfinv(torch.from_numpy(2.0 * u[:, 1] - 1.0))  # [G R] standard normal
        beta = (self.shape.sharpness * torch.exp(self.shape.sharpness_spread * z)).float()  # [G R]
        gumbel = torch.from_numpy(-np.log(-np.log(u[:, 2:])) - _EULER_GAMMA).float()  # [G R, M]
        head = self.head_base[None, :] + self.shape.noise * gumbel  # [G R, M]
        ids = (torch.from_numpy(offset)[:, None] + self.offsets[None, :]) % V  # [G R, M]
        return [
            (beta[g * R : (g + 1) * R], ids[g * R : (g + 1) * R], head[g * R : (g + 1) * R]) for g in range(len(roles))
        ]

    def logits(self, contexts: Sequence[Sequence[int]]) -> Tensor:
        """[R, V] float32: row r is the next-token logits after contexts[r]."""
        if not contexts:
            return torch.empty(0, self.vocab_size)
        last = self._last_ids(contexts)  # [R, n]
        if self.agreement is None or self.agreement == 1.0:
            ((beta_p, ids_p, head_p),) = self._components(last, (TARGET_ROLE,))
            out = beta_p[:, None] * self.background[None, :]  # [R, V]
            return out.scatter_(1, ids_p, beta_p[:, None] * head_p)
        a = self.agreement
        (beta_p, ids_p, head_p), (beta_r, ids_r, head_r) = self._components(last, (TARGET_ROLE, DRAFT_NOISE_ROLE))
        cp, cr = a * beta_p, (1.0 - a) * beta_r  # [R] weights of the two components
        out = (cp + cr)[:, None] * self.background[None, :]  # [R, V]: both share the background
        # Replace each component's background by its head (ids distinct within a component;
        # two separate scatter_adds keep overlaps between the components exact).
        out.scatter_add_(1, ids_p, cp[:, None] * (head_p - self.background[ids_p]))
        out.scatter_add_(1, ids_r, cr[:, None] * (head_r - self.background[ids_r]))
        return out
