"""Sampling: the request's processed distribution p, counter-based coins, drawing tokens.

Pure, batched tensor functions, shared by the draft (which samples its
tokens from exactly the numbers it sends) and the target (whose rejection
sampler, specd.core.sampling.rejection, draws the recovered and bonus tokens).
specd.core.sampling.rejection's docstring has the words and the exactness rules.

Greedy (temperature 0) needs no special case: p is one-hot at the argmax,
so a draft token is accepted iff it is the argmax, and the residual is
one-hot at the argmax. Temperatures below TEMPERATURE_FLOOR are greedy too:
dividing float32 logits by, say, 1e-45 gives inf and NaN, and the limit of
softmax(x / T) as T -> 0 is the argmax anyway (vLLM draws the same line).

Coins are independent uniforms: each is a hash of (seed, position, role)
(:func:`coins`), so the output depends on the request seed only, never on
call order, batching, pipelining or retries.

Nothing here relies on `assert` to check numbers that come from a request or
a model: a row that cannot be sampled raises a domain error (InvalidArgument
for the caller's own input, Internal for non-finite model numbers), and
`unusable_rows` finds such rows of a batch before anything is sampled, so
that a batched caller can fail them alone.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import Internal, InvalidArgument, SpecdError
from specd.core.sampling.filter_mask import kept_mask

__all__ = [
    "MAX_TEMPERATURE",
    "TEMPERATURE_FLOOR",
    "UNUSABLE_LOGITS",
    "UNUSABLE_PROBS",
    "Role",
    "SamplingParams",
    "coin_values",
    "coins",
    "draft_token",
    "host_coins",
    "processed_probs",
    "sample_from_probs",
    "sample_sparse",
    "sampled_mass",
    "sparse_proposal",
    "token_coins",
    "unusable_logits",
    "unusable_probs",
    "unusable_rows",
]

# Temperatures in (0, TEMPERATURE_FLOOR) act as greedy (temperature 0): see the module docstring.
TEMPERATURE_FLOOR = 1e-5
# The largest temperature accepted. Far above any useful value; it keeps T finite in float32.
MAX_TEMPERATURE = 100.0
# top_k travels as uint32; a larger value cannot come from the wire and means "off" anyway.
MAX_TOP_K = 2**32 - 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings (the target and the draft both apply them)."""

    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1)
    seed: int = 0  # every coin derives from (seed, position, role)

    def validate(self) -> SamplingParams:
        """Return self, or raise InvalidArgument naming the field to fix.

        Every float is checked for being a finite number in its range (NaN fails
        every comparison, so each check is written to pass only on good values).
        """
        t = self.temperature
        _require(
            _is_real(t) and math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE,
            f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 means greedy; "
            f"below {TEMPERATURE_FLOOR:g} acts as greedy), got {t!r}",
        )
        _require(
            isinstance(self.top_k, numbers.Integral)
            and not isinstance(self.top_k, bool)
            and 0 <= self.top_k <= MAX_TOP_K,
            f"top_k must be an integer in [0, {MAX_TOP_K}] (0 means off), got {self.top_k!r}",
        )
        _require(
            _is_real(self.top_p) and math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0,
            f"top_p must be in (0, 1] (1 means off), got {self.top_p!r}",
        )
        _require(
            _is_real(self.min_p) and math.isfinite(self.min_p) and 0.0 <= self.min_p < 1.0,
            f"min_p must be in [0, 1) (0 means off), got {self.min_p!r}",
        )
        _require(
            isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**63,
            f"seed must be an integer in [0, 2**63), got {self.seed!r}",
        )
        return self

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or below the floor (where x / T would overflow float32)."""
        return self.temperature < TEMPERATURE_FLOOR


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# --------------------------------------------------------------------------
# Coins
# --------------------------------------------------------------------------


class Role(enum.IntEnum):
    """Which coin: each role is an independent stream of uniforms."""

    DRAFT = 1  # draft samples its proposal token
    ACCEPT = 2  # target's accept/reject coin
    RECOVER = 3  # target samples the recovered token from the residual
    BONUS = 4  # target samples the bonus token from p (the tail's token, specd.core.sampling.bonus_race)
    BONUS_RACE = 5  # the bonus race's clock of each head token (token_coins: one per token id)
    BONUS_TAIL = 6  # the bonus race's clock of the tail


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 increment (odd)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
# Up to this many coins per call, the hash runs on Python integers (a round's few coins: ~1 us
# each, against ~25 us of numpy's per-call overhead); above it, vectorised in numpy. Same values.
_SCALAR_COINS = 64


def _mix64(z: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: a bijection of uint64 with good avalanche.
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def _mix64_int(z: int) -> int:
    """_mix64 of one Python integer in [0, 2**64) (the same bijection, wrapping explicitly)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def coins(seeds: Tensor, positions: Tensor, role: Role) -> Tensor:
    """Uniforms in [0, 1) that depend only on (seed, position, role).

    seeds:     [B] int64 request seeds
    positions: [B, N] int64 absolute token positions in the sequence
    returns:   [B, N] float64, multiples of 2**-53, on positions' device

    Counter-based (no generator state): h = mix(mix(mix(seed + G) ^ (pos + 2G))
    ^ role * 3G) in wrapping uint64 arithmetic; each step is injective in its
    new input, so distinct positions (or roles) of one seed never collide.
    """
    assert seeds.dim() == 1, f"seeds must be [B], got {tuple(seeds.shape)}"
    assert positions.dim() == 2 and positions.shape[0] == seeds.shape[0], (
        f"positions must be [B, N] with B={seeds.shape[0]}, got {tuple(positions.shape)}"
    )
    assert not seeds.is_floating_point() and not positions.is_floating_point()
    u = host_coins(
        seeds.detach().to("cpu", torch.int64).numpy(), positions.detach().to("cpu", torch.int64).numpy(), role
    )
    return torch.from_numpy(u).to(positions.device)


def host_coins(seeds: np.ndarray, positions: np.ndarray, role: Role) -> np.ndarray:
    """:func:`coins` on host arrays: seeds [B] int64, positions [B, N] int64 -> [B, N] float64.

    A few coins (a round's) are hashed in Python integers, more in vectorised numpy: the same numbers.
    """
    role = Role(role)
    if positions.size <= _SCALAR_COINS:
        u = coin_values(seeds.tolist(), positions.tolist(), role)
        return np.asarray(u, dtype=np.float64).reshape(positions.shape)
    h = coin_states(np.asarray(seeds)[:, None], positions, role)  # [B, N]
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # top 53 bits -> [0, 1)


def coin_values(seeds: Sequence[int], positions: Sequence[Sequence[int]], role: Role) -> list[float]:
    """:func:`coins` in Python integers, flattened: [B x N] row-major (the same numbers, for a few coins).

    seeds: B int64 seeds; positions: B rows of N int64 positions (negative values wrap as uint64).
    """
    salt = _role_salt(role)
    out: list[float] = []
    for seed, row in zip(seeds, positions):
        h0 = _seed_state(seed)
        for pos in row:
            out.append((_coin_state(h0, pos, salt) >> 11) * (1.0 / (1 << 53)))
    return out


def _seed_state(seed: int) -> int:
    """The coin hash's state after the seed: mix(seed + G)."""
    return _mix64_int((seed + int(_GOLDEN)) & _MASK)


def _role_salt(role: Role) -> int:
    return (int(role) * 3 * int(_GOLDEN)) & _MASK


def _coin_state(h0: int, position: int, salt: int) -> int:
    """The (seed, position, role) coin's 64-bit state from the seed's (_seed_state) and the role's salt."""
    return _mix64_int(_mix64_int(h0 ^ ((position + 2 * int(_GOLDEN)) & _MASK)) ^ salt)


def token_coins(seed: int, position: int, role: Role, ids: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per token id at (seed, position, role): ids [n] int64 -> [n] float64.

    The (seed, position, role) coin's 64-bit state, mixed once more with each id (x (id + 1) * 5G):
    injective in the id, so distinct tokens never share a coin, and independent of every other coin."""
    h = np.uint64(_coin_state(_seed_state(seed), position, _role_salt(role)))
    return token_coins_at(np.broadcast_to(h, np.shape(ids)), ids)


def coin_states(seeds: np.ndarray, positions: np.ndarray, role: Role) -> np.ndarray:
    """The (seed, position, role) coins' 64-bit states (host_coins, token_coins_at): int64 seeds and positions
    of shapes that broadcast ([B] and [B], or [B, 1] and [B, N]) -> uint64 of their broadcast shape."""
    # numpy uint64 arithmetic wraps modulo 2**64 by definition; torch has no portable wrapping uint64.
    s = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    p = np.asarray(positions, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix64(s + _GOLDEN)
        h = _mix64(h ^ (p + _GOLDEN * np.uint64(2)))
        return _mix64(h ^ np.uint64(_role_salt(role)))


def token_coins_at(states: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """token_coins of many (state, id) pairs: states [n] uint64 (coin_states), ids [n] int64 -> [n] float64."""
    salt = np.uint64((5 * int(_GOLDEN)) & _MASK)
    t = np.asarray(ids, dtype=np.int64).view(np.uint64)  # [n]
    with np.errstate(over="ignore"):
        z = _mix64(states ^ ((t + np.uint64(1)) * salt))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------
# Processed distribution p
# --------------------------------------------------------------------------


def processed_probs(logits: Tensor, params: Sequence[SamplingParams], *, checked: bool = False) -> Tensor:
    """The request's processed distribution: what the bonus token is drawn from.

    logits:  [B, N, V] any float dtype; row b uses params[b]
    checked: the params were validated already (a session's, when it opened): skip that
    returns: [B, N, V] float32, each [b, n] row sums to 1

    Order: temperature -> softmax (float32) -> top-k -> top-p -> min-p ->
    renormalise. top-p keeps the smallest set of most likely tokens whose
    mass (after top-k) is >= top_p, always the top token; min-p keeps
    p >= min_p * max p. Ties in rank go to the lower token id. The kept set
    comes from a row's first ranks where they decide it, else from a sort of
    the whole row (specd.core.sampling.filter_mask).
    Temperature 0 (or below TEMPERATURE_FLOOR): one-hot at argmax of the
    float32 logits (lowest id on ties).

    Rows never mix: a row's numbers depend on its own logits and settings only,
    so a row with NaN logits gives a NaN row and leaves the others exact
    (`unusable_rows` finds it).
    """
    assert logits.dim() == 3, f"logits must be [B, N, V], got {tuple(logits.shape)}"
    assert logits.is_floating_point(), f"logits must be floating point, got {logits.dtype}"
    B, N, V = logits.shape
    _require(len(params) == B, f"need one SamplingParams per row: {len(params)} for {B} rows")
    _require(V > 0, "vocabulary size must be > 0")
    if not checked:
        for sp in set(params):
            sp.validate()
    dev = logits.device
    x = logits.to(torch.float32)  # [B, N, V]
    if _plain_softmax(params):  # the common batch: one temperature, no filters, no greedy row
        return torch.softmax(x / params[0].temperature, dim=-1)  # [B, N, V]; x / T in float32 as below

    greedy = torch.tensor([sp.is_greedy for sp in params], device=dev)  # [B]
    temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev)  # [B]
    # x / T in float32 (greedy rows are replaced below; divide them by 1).
    probs = torch.softmax(x / torch.where(greedy, 1.0, temp)[:, None, None], dim=-1)  # [B, N, V]

    # Rows without filters keep the plain softmax; the others always take the
    # filter path. A row's numbers therefore never depend on its batch-mates.
    filtered = [0 < sp.top_k < V or sp.top_p < 1.0 or sp.min_p > 0.0 for sp in params]
    if any(filtered):
        rows = [b for b, f in enumerate(filtered) if f]  # B' filtered rows, each [N, V]
        top_k = torch.tensor([params[b].top_k if 0 < params[b].top_k < V else V for b in rows], device=dev)  # [B']
        top_p = torch.tensor([params[b].top_p for b in rows], dtype=torch.float64, device=dev)  # [B']
        min_p = torch.tensor([params[b].min_p for b in rows], dtype=torch.float32, device=dev)  # [B']
        every = len(rows) == B  # the usual batch: one request's rows, or every request filtered alike
        chosen = probs if every else probs[rows]  # [B', N, V]
        mask = kept_mask(  # [B' N, V]: each position's row under its request's filters
            chosen.reshape(-1, V), top_k.repeat_interleave(N), top_p.repeat_interleave(N), min_p.repeat_interleave(N)
        ).reshape(len(rows), N, V)
        kept = chosen.mul_(mask) if every else chosen * mask  # probs is this function's own tensor
        kept.div_(kept.sum(-1, keepdim=True))
        if not every:
            probs[rows] = kept

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)  # [B, N, V]
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def _plain_softmax(params: Sequence[SamplingParams]) -> bool:
    """True if every row is softmax(x / T) with one T: no greedy row, no filter (processed_probs' fast path).

    x / T with T a Python float divides in float32 by float32(T), as the general path's
    per-row float32 temperatures do (tests/unit/core/sampling/test_sampling.py checks the bits)."""
    t = params[0].temperature
    return not params[0].is_greedy and all(
        sp.temperature == t and sp.top_k == 0 and sp.top_p >= 1.0 and sp.min_p <= 0.0 for sp in params
    )


# What a request whose logits cannot be sampled is told (its own failure: the batch goes on).
UNUSABLE_LOGITS = "the model's logits for this request are not finite"


# What a request whose processed p is not a distribution is told (its logits were fine).
UNUSABLE_PROBS = "the sampling distribution for this request is not finite"


def unusable_rows(logits: Tensor, probs: Tensor, *, sampled: bool = False) -> dict[int, SpecdError]:
    """The rows of a batch that cannot be sampled, each with the error its request gets.

    logits: [B, N, V] the model's raw logits; probs: [B, N, V] processed_probs of them
    sampled: no row is greedy. A NaN or an infinite logit, or a row of -inf, makes a softmax
             row NaN, so only a row whose p is bad can have bad logits: the logits are then
             read only for those rows (to name the error), saving a pass over the batch.
    returns: {row: Internal} for rows whose logits hold NaN or +inf or no finite
             value at some position (a greedy row's argmax would silently pick a
             NaN), or whose processed p is not a distribution (not finite, or no mass).
    -inf logits are fine (masked or absent tokens) as long as one logit is finite.
    """
    assert logits.shape == probs.shape and logits.dim() == 3, (
        f"logits and probs must both be [B, N, V], got {tuple(logits.shape)} and {tuple(probs.shape)}"
    )
    bad_p = unusable_probs(probs)
    if sampled:
        if not bad_p:
            return {}
        rows = sorted(bad_p)
        bad_x = unusable_logits(logits[torch.tensor(rows, device=logits.device)])
        out = {rows[r]: error for r, error in bad_x.items()}
    else:
        out = unusable_logits(logits)
    for b, error in bad_p.items():
        out.setdefault(b, error)
    return out


def sampled_mass(logits: Tensor, probs: Tensor) -> tuple[np.ndarray, dict[int, SpecdError]]:
    """Rows to sample from (no greedy row): each one's float64 mass, and the rows that cannot be sampled.

    logits, probs: [B, V]; returns (total [B] float64 = probs.double().sum(-1), on the host;
    {row: Internal} as unusable_rows(logits[:, None], probs[:, None], sampled=True) gives it).
    One pass over p serves both: a float64 sum of p >= 0 is finite and positive iff p's is.
    """
    assert logits.shape == probs.shape and logits.dim() == 2, f"need [B, V] rows, got {tuple(probs.shape)}"
    total = probs.sum(-1, dtype=torch.float64).cpu().numpy()  # [B]
    bad = np.flatnonzero(~(np.isfinite(total) & (total > 0)))
    if not bad.size:
        return total, {}
    rows = torch.from_numpy(bad).to(logits.device)
    out = {int(bad[r]): error for r, error in unusable_logits(logits[rows][:, None]).items()}
    for b in bad.tolist():
        out.setdefault(b, Internal(UNUSABLE_PROBS))
    return total, out


def unusable_logits(logits: Tensor) -> dict[int, SpecdError]:
    """unusable_rows' check of the logits alone: {row: Internal(UNUSABLE_LOGITS)} (logits [B, N, V])."""
    x = logits.detach()
    # One pass over the logits (the precise check runs only on the rows it flags): a row's sum is
    # finite unless it holds a NaN or an infinity (or overflows). Its [B, N] sums are read on the host.
    suspect = ~np.isfinite(x.sum(-1).float().cpu().numpy()).all(-1)  # [B]
    if not suspect.any():
        return {}
    rows = torch.from_numpy(np.flatnonzero(suspect)).to(x.device)
    xs = x[rows]
    bad = (xs.isnan() | (xs == math.inf)).flatten(1).any(-1) | (xs.amax(-1) == -math.inf).any(-1)  # [S]
    return {b: Internal(UNUSABLE_LOGITS) for b in rows[bad].tolist()}


def unusable_probs(probs: Tensor) -> dict[int, SpecdError]:
    """unusable_rows' check of p alone: {row: Internal(UNUSABLE_PROBS)} (probs [B, N, V] or [B, V]).

    A p row's sum is finite and positive iff the row is finite with mass (p >= 0, sum <= V).
    """
    p_sum = probs.detach().sum(-1).float().cpu().numpy().reshape(probs.shape[0], -1)  # [B, N]
    bad = ~(np.isfinite(p_sum) & (p_sum > 0)).all(-1)  # [B]
    return {b: Internal(UNUSABLE_PROBS) for b in np.flatnonzero(bad).tolist()}


# --------------------------------------------------------------------------
# Drawing tokens
# --------------------------------------------------------------------------


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling in float64.

    probs:   [..., V] non-negative weights, not necessarily normalised
    u:       [...] float64 uniforms in [0, 1)
    returns: [...] int64, the first index whose cumulative sum > u * total

    A zero-weight token is never chosen (its cumsum equals its predecessor's).
    """
    assert probs.dim() >= 1 and u.shape == probs.shape[:-1], (
        f"u must be probs.shape[:-1]={tuple(probs.shape[:-1])}, got {tuple(u.shape)}"
    )
    assert probs.shape[-1] > 0, "cannot sample from an empty distribution"
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [..., V]
    total = cdf[..., -1]  # [...]
    if not bool(((total > 0) & total.isfinite()).all()):
        raise Internal("a distribution to sample from has no finite positive mass")
    target = (u.to(torch.float64) * total).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf, target.contiguous(), right=True).squeeze(-1)  # [...]
    # The first index whose cdf exceeds u*total has weight > 0 (a zero weight repeats the cdf
    # before it), unless there is none: u*total rounded up to total. Then fall back to the
    # last token with weight > 0.
    V = probs.shape[-1]
    over = idx >= V  # [...]
    if bool(over.any()):
        last_pos = (V - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(-1)  # [...]
        idx = torch.where(over, last_pos, idx)
    return idx.to(torch.int64)


def sparse_proposal(probs: Tensor, wire_top_k: int, wire_bits: int = 16) -> tuple[Tensor, Tensor]:
    """The sparse proposal q the draft both sends and samples from.

    probs:   [B, V] float32, the draft's processed distribution
    returns: (ids [B, W] int64, wire_probs [B, W] float32), W = min(wire_top_k, V),
             slots most likely first (ties: lower id first)

    t = top-W of probs, renormalised (float64); r = round(t * 2**bits) / 2**bits
    (half to even), the top slot at least 2**-bits so the row never vanishes;
    wire = float32(r / sum r). A slot rounded to 0 has probability 0 (its id is
    kept but it is never sampled). The float32 wire numbers *are* q.
    """
    _require(isinstance(wire_top_k, int) and wire_top_k >= 1, f"wire_top_k must be an integer >= 1, got {wire_top_k!r}")
    _require(
        isinstance(wire_bits, int) and 1 <= wire_bits <= 24,
        f"wire_bits must be an integer in [1, 24], got {wire_bits!r}",
    )
    assert probs.dim() == 2 and probs.shape[-1] > 0, f"probs must be [B, V], got {tuple(probs.shape)}"
    assert probs.is_floating_point(), f"probs must be floating point, got {probs.dtype}"
    W = min(wire_top_k, probs.shape[-1])
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # [B, V] each
    vals, ids = vals[:, :W].to(torch.float64), ids[:, :W]  # [B, W]
    total = vals.sum(-1, keepdim=True)  # [B, 1]
    if not bool((total > 0).all()) or not bool(total.isfinite().all()):
        raise Internal("the draft's probabilities have no finite positive mass in their top-k")
    t = vals / total  # truncated, renormalised
    scale = float(2**wire_bits)
    r = torch.round(t * scale) / scale  # on the wire grid
    r[:, 0] = torch.clamp(r[:, 0], min=1.0 / scale)  # keep the most likely token
    wire = (r / r.sum(-1, keepdim=True)).to(torch.float32)  # [B, W]
    return ids.to(torch.int64), wire


def sample_sparse(ids: Tensor, wire_probs: Tensor, u: Tensor) -> Tensor:
    """Draw from a sparse distribution.

    ids:        [B, W] int64 token ids
    wire_probs: [B, W] float32 weights (normalised in float64 here)
    u:          [B] float64 uniforms
    returns:    [B] int64 token ids (inverse CDF over the W slots in order)
    """
    assert ids.shape == wire_probs.shape and ids.dim() == 2, (
        f"ids and wire_probs must both be [B, W], got {tuple(ids.shape)} and {tuple(wire_probs.shape)}"
    )
    assert u.shape == ids.shape[:1], f"u must be [B]={tuple(ids.shape[:1])}, got {tuple(u.shape)}"
    q = wire_probs.to(torch.float64)
    q = q / q.sum(-1, keepdim=True)  # [B, W] the proposal, exactly as the target computes it
    slot = sample_from_probs(q, u)  # [B]
    return ids.gather(-1, slot[:, None]).squeeze(-1)


def draft_token(
    probs: Tensor, wire_top_k: int, wire_bits: int, seeds: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter's step for one position: sample from exactly what is sent.

    probs:     [B, V] float32 the draft's processed distribution
    seeds:     [B] int64
    positions: [B] int64 absolute position of the token being drafted
    returns:   (token [B] int64, ids [B, W] int64, wire_probs [B, W] float32)
    """
    assert probs.dim() == 2 and seeds.shape == positions.shape == probs.shape[:1]
    ids, wire = sparse_proposal(probs, wire_top_k, wire_bits)
    u = coins(seeds, positions[:, None], Role.DRAFT)[:, 0]  # [B]
    return sample_sparse(ids, wire, u), ids, wire
