"""The speculative rejection sampler: the target's verdict on a round's draft tokens.

Words (vLLM's, used everywhere in specd):

- **draft tokens**: the K tokens x_0..x_{K-1} the draft proposes after the
  committed prefix, x_i drawn from the draft's proposal distribution q_i.
- **accepted**: draft token x_i is kept iff u < min(1, p_i(x_i) / q_i(x_i)),
  where p_i is the target's processed distribution at that position and u
  a uniform coin. Verification stops at the first rejection.
- **recovered** token: at the first rejection j the target draws a token
  from the residual normalise(max(0, p_j - q_j)) over the full vocabulary.
- **bonus** token: when all drafts are accepted the target draws one more
  token from p_K, the position after the last draft (by the race of
  specd.core.sampling.bonus_race, which a pipelined draft's guess of it shares).

Every verify round therefore emits ``num_accepted + 1`` tokens, and the
emitted sequence has exactly the distribution of sampling from p alone
(Leviathan et al. 2023, Chen et al. 2023), provided that:

- q is exactly what the draft sampled from: the draft truncates its
  distribution to the tokens it sends, renormalises, rounds to the wire
  precision, renormalises again and samples from *those* numbers
  (specd.core.sampling.sparse_q; the fixed top-k :func:`specd.core.sampling.sampler.sparse_proposal`
  and :func:`specd.core.sampling.sampler.draft_token`);
- both sides normalise the wire numbers the same way (float64);
- coins are independent uniforms: each is a hash of (seed, position, role)
  (:func:`specd.core.sampling.sampler.coins`), so the output depends on the request
  seed only, never on call order, batching, pipelining or retries.

p itself (temperature, top-k, top-p, min-p; greedy as the limit case) is
:func:`specd.core.sampling.sampler.processed_probs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specd.core.errors import Internal, InvalidArgument
from specd.core.sampling.bonus_race import race_draw_rows
from specd.core.sampling.sampler import Role, host_coins, sample_from_probs

__all__ = ["SparseProposal", "TargetRows", "Verdict", "rejection_sample"]

# Below this residual mass, p == q up to rounding: sample from p instead.
ZERO_RESIDUAL = 1e-12


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


@dataclass(frozen=True)
class SparseProposal:
    """The draft's proposal for its K positions, as sent on the wire."""

    token_ids: Tensor  # [B, K, W] int64 (unused slots: id 0 with prob 0)
    probs: Tensor  # [B, K, W] float32 wire values; q = probs / probs.sum(-1) in float64


@dataclass(frozen=True)
class Verdict:
    """The target's decision for one round, per row."""

    num_accepted: Tensor  # [B] int64 in [0, num_draft[b]]
    next_token: Tensor  # [B] int64: recovered token at the first rejection, else the bonus token
    is_bonus: Tensor  # [B] bool: all drafts accepted, next_token drawn from p_{num_draft}


@dataclass(frozen=True)
class TargetRows:
    """The target's processed p for a round, read by (row, position) only where the verdict needs it.

    shape:  (B, K+1, V)
    device: where the rows are read to
    read:   (rows [n] int64, positions [n] int64) -> p at those (row, position) pairs, [n, V]
            (it may raise for a row whose p cannot be sampled: the caller finds which)
    """

    shape: tuple[int, int, int]
    device: torch.device
    read: Callable[[np.ndarray, np.ndarray], Tensor]

    @staticmethod
    def dense(p: Tensor) -> TargetRows:
        """Rows of a whole [B, K+1, V] tensor."""
        _require(p.dim() == 3, f"target_probs must be [B, K+1, V], got {tuple(p.shape)}")
        assert p.is_floating_point(), f"target_probs must be floating point, got {p.dtype}"
        B, K1, V = p.shape
        return TargetRows((B, K1, V), p.device, lambda b, i: p[torch.from_numpy(b), torch.from_numpy(i)])


def rejection_sample(
    target_probs: Tensor | TargetRows,
    draft_token_ids: Tensor,
    proposal: SparseProposal | None,
    seeds: Tensor,
    start_positions: Tensor,
    num_draft: Tensor | None = None,
) -> Verdict:
    """Verify draft tokens against the target's p (see the module docstring).

    target_probs:    [B, K+1, V] float32 processed p at each draft position and one more
                     (or TargetRows: the same numbers, read on demand)
    draft_token_ids: [B, K] int64
    proposal:        sparse q per position ([B, K, W]); None => q one-hot at the draft token
    seeds:           [B] int64 request seeds
    start_positions: [B] int64 absolute position of draft token 0 (draft i at start+i)
    num_draft:       [B] int64 real drafts per row (default K); slots >= num_draft[b] are
                     padding: never accepted, q = 0 there, so stopping at i = num_draft[b]
                     draws the bonus from p_i.

    p is read only where the verdict depends on it: position i of row b while the drafts before
    i were accepted (the value p_i(x_i)), and the row p_j the emitted token is drawn from (its
    residual differs from p_j only on q_j's support, so only those entries are rewritten). The
    verdict's small numbers ([B, K] and [B, K, W]) are worked on the host, in float64, with the
    same arithmetic as the dense formulas above (tests/unit/core/sampling/reference.py).
    """
    rows = target_probs if isinstance(target_probs, TargetRows) else TargetRows.dense(target_probs)
    B, K, V = _check_shapes(rows.shape, draft_token_ids, seeds, start_positions)
    nd = _num_draft(num_draft, B, K)  # [B]
    ids = draft_token_ids.detach().to("cpu", torch.int64).numpy()  # [B, K]
    real = np.arange(K)[None, :] < nd[:, None]  # [B, K] real (non-padding) drafts
    bad = real & ((ids < 0) | (ids >= V))
    if bad.any():
        raise InvalidArgument(f"draft token ids must be in [0, V={V}): {_first_bad(bad, ids)}")
    x = np.where(real, ids, 0)  # [B, K] padding -> a safe id
    q_ids, q_raw, q_sum = _proposal(proposal, x, real, V)  # [B, K, W], [B, K, W], [B, K]
    q_x = _q_at(q_ids, q_raw, q_sum, x)  # [B, K] q_i(x_i)
    bad = real & (q_x <= 0)
    if bad.any():
        raise InvalidArgument(f"a draft token must be in its own proposal's support (q > 0): {_first_bad(bad, ids)}")
    seed = seeds.detach().to("cpu", torch.int64).numpy()  # [B]
    start = start_positions.detach().to("cpu", torch.int64).numpy()  # [B]

    # ---- accept: u < min(1, p(x) / q(x)), position by position, while the run of accepts lasts ----
    u_acc = host_coins(seed, start[:, None] + np.arange(K)[None, :], Role.ACCEPT)  # [B, K]
    num_accepted, p_j = _accept(rows, x, q_x, u_acc, nd)  # [B], B rows [V] (None: the bonus, not read yet)
    is_bonus = num_accepted == nd  # [B]
    j = num_accepted  # [B] position of the emitted token
    bonus = np.flatnonzero(is_bonus)
    if bonus.size:
        for n, row in enumerate(rows.read(bonus, j[bonus])):
            p_j[int(bonus[n])] = row

    # ---- recovered: sample normalise(max(0, p_j - q_j)); bonus: the race over p_K (bonus_race) ----
    pos_j = start + j  # [B]
    emitted = [row for row in p_j if row is not None]
    assert len(emitted) == B
    next_token = np.zeros(B, dtype=np.int64)
    if bonus.size:
        next_token[bonus] = race_draw_rows([emitted[b] for b in bonus.tolist()], seed[bonus], pos_j[bonus])
    rec = np.flatnonzero(~is_bonus)
    if rec.size:
        u = host_coins(seed[rec], pos_j[rec, None], Role.RECOVER)[:, 0]  # [R]
        jq = j[rec]  # [R] < K: a rejection happened at a draft position
        q_j = q_raw[rec, jq] / q_sum[rec, jq][:, None]  # [R, W] q = wire / sum (> 0 at a real draft)
        recovered = [emitted[b] for b in rec.tolist()]
        next_token[rec] = _draw(recovered, q_ids[rec, jq], q_j, u).numpy()
    return Verdict(
        num_accepted=torch.from_numpy(num_accepted).to(rows.device),
        next_token=torch.from_numpy(next_token).to(rows.device),
        is_bonus=torch.from_numpy(is_bonus).to(rows.device),
    )


def _accept(
    rows: TargetRows, x: np.ndarray, q_x: np.ndarray, u: np.ndarray, nd: np.ndarray
) -> tuple[np.ndarray, list[Tensor | None]]:
    """The leading run of accepts of each row, reading position i of a row only while the run lasts.

    x: [B, K] draft tokens; q_x: [B, K] q_i(x_i); u: [B, K] accept coins; nd: [B] real drafts.
    Draft i is accepted iff u < min(1, p_i(x_i) / q_i(x_i)) (float64); padding (i >= nd) ends a
    run. Returns (accepted [B] int64, per row the p row it was rejected at, or None). The numbers
    are a round's few: Python floats (IEEE doubles, as numpy's) and one read per position.
    """
    B, K = x.shape
    xs, qs, us, ends = x.tolist(), q_x.tolist(), u.tolist(), nd.tolist()
    accepted = [0] * B
    rejected_at: list[Tensor | None] = [None] * B
    going = list(range(B))
    for i in range(K):
        going = [b for b in going if i < ends[b]]
        if not going:
            break
        p_i = rows.read(np.array(going, dtype=np.int64), np.full(len(going), i, dtype=np.int64))  # [n, V]
        at = torch.tensor([xs[b][i] for b in going], dtype=torch.int64, device=p_i.device)  # [n]
        p_x = p_i[torch.arange(len(going), device=p_i.device), at].tolist()  # [n] p_i(x_i)
        still = []
        for n, b in enumerate(going):
            if us[b][i] < min(p_x[n] / qs[b][i], 1.0):
                accepted[b] += 1
                still.append(b)
            else:
                rejected_at[b] = p_i[n]  # the recovered token is drawn from this row
        going = still
    return np.array(accepted, dtype=np.int64), rejected_at


def _check_shapes(
    shape: tuple[int, int, int], draft_token_ids: Tensor, seeds: Tensor, start_positions: Tensor
) -> tuple[int, int, int]:
    """(B, K, V) of a verify's inputs, or InvalidArgument naming the one out of shape."""
    B, K1, V = shape
    K = K1 - 1
    _require(K >= 0 and V > 0, f"target_probs must have K+1 >= 1 positions and V >= 1, got {tuple(shape)}")
    _require(
        draft_token_ids.shape == (B, K),
        f"draft_token_ids must be [B, K]=[{B}, {K}] to match target_probs, got {tuple(draft_token_ids.shape)}",
    )
    _require(seeds.shape == (B,), f"seeds must be [B]=[{B}], got {tuple(seeds.shape)}")
    _require(start_positions.shape == (B,), f"start_positions must be [B]=[{B}], got {tuple(start_positions.shape)}")
    assert not draft_token_ids.is_floating_point() and not seeds.is_floating_point()
    assert not start_positions.is_floating_point()
    return B, K, V


def _num_draft(num_draft: Tensor | None, B: int, K: int) -> np.ndarray:
    """[B] int64 real drafts per row (default K), checked to be in [0, K]."""
    if num_draft is None:
        return np.full(B, K, dtype=np.int64)
    _require(num_draft.shape == (B,), f"num_draft must be [B]=[{B}], got {tuple(num_draft.shape)}")
    nd = num_draft.detach().to("cpu", torch.int64).numpy()
    _require(bool(((nd >= 0) & (nd <= K)).all()), f"num_draft must be in [0, K={K}]")
    return nd


def _proposal(
    proposal: SparseProposal | None, x: np.ndarray, real: np.ndarray, V: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The proposal on the host: (ids [B, K, W] int64, wire [B, K, W] float64, its sums [B, K]).

    q = wire / sum (float64), 0 on padding. x: [B, K] the draft tokens (padding: 0); real: [B, K]
    bool. No proposal: q one-hot at x (W = 1, wire = 1 on real drafts).
    """
    B, K = x.shape
    if proposal is None:
        one = real.astype(np.float64)  # [B, K]
        return x[..., None], one[..., None], np.where(real, 1.0, 0.0)
    q_ids_t, q_raw_t = proposal.token_ids, proposal.probs
    _require(
        q_ids_t.dim() == 3 and q_ids_t.shape[:2] == (B, K) and q_raw_t.shape == q_ids_t.shape,
        f"proposal token_ids and probs must both be [B, K, W] with B={B}, K={K}, "
        f"got {tuple(q_ids_t.shape)} and {tuple(q_raw_t.shape)}",
    )
    q_ids = q_ids_t.detach().to("cpu", torch.int64).numpy()  # [B, K, W]
    q_raw = q_raw_t.detach().to("cpu", torch.float64).numpy()  # [B, K, W]
    _require(
        q_ids.size == 0 or 0 <= int(q_ids.min()) <= int(q_ids.max()) < V, f"proposal token ids must be in [0, V={V})"
    )
    q_sum = q_raw.sum(-1)  # [B, K]
    # Non-negative float32 numbers sum to a finite float64 unless one is NaN or infinite.
    _require(
        q_raw.size == 0 or (float(q_raw.min()) >= 0 and bool(np.isfinite(q_sum).all())),
        "proposal probabilities must be finite and >= 0",
    )
    _require(not bool((real & (q_sum <= 0)).any()), "each real draft position needs a proposal with positive mass")
    return q_ids, q_raw, q_sum


def _q_at(q_ids: np.ndarray, q_raw: np.ndarray, q_sum: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[B, K] q_i(x_i) = sum over the slots holding x_i of wire / sum (float64; duplicates add up).

    One slot (the rule: ids are distinct): its wire / sum, as the dense formula divides first.
    """
    match = q_ids == x[..., None]  # [B, K, W]
    safe = np.where(q_sum > 0, q_sum, 1.0)  # [B, K] (padding: no mass)
    if bool((match.sum(-1) > 1).any()):  # an id twice: divide each slot, then add, as the dense formula
        return np.where(match, q_raw / safe[..., None], 0.0).sum(-1)
    return (q_raw * match).sum(-1) / safe


def _draw(p_j: list[Tensor], q_ids: np.ndarray, q: np.ndarray, u: np.ndarray) -> Tensor:
    """[B] int64: each row's recovered token, drawn from max(0, p_j - q_j) (the bonus is bonus_race's).

    p_j: B rows [V] of p; q_ids, q: [B, W] q_j (float64); u: [B] float64 coins. Rows in host
    memory are drawn in numpy, others by the torch path; the same numbers either way.
    """
    if all(row.device.type == "cpu" and row.dtype in (torch.float32, torch.float64) for row in p_j):
        out = [_draw_host(row.detach().numpy(), q_ids[b], q[b], float(u[b])) for b, row in enumerate(p_j)]
        return torch.tensor(out, dtype=torch.int64)
    residual = _residual(torch.stack(p_j), q_ids, q)  # [B, V] float64
    return sample_from_probs(residual, torch.from_numpy(u).to(residual.device))


def _residual(p_j: Tensor, q_ids: np.ndarray, q: np.ndarray) -> Tensor:
    """[B, V] float64: max(0, p_j - q_j), each row's residual at its rejected position.

    The dense q_j is 0 off its support, where max(0, p_j - 0) = p_j: only the support's entries
    change. A row left without mass (p == q up to rounding) falls back to p_j (ZERO_RESIDUAL).
    """
    B, V = p_j.shape
    dev = p_j.device
    residual = p_j.to(torch.float64)  # [B, V] (a copy)
    at = torch.from_numpy((np.arange(B)[:, None] * V + q_ids).ravel()).to(dev)  # [B*W] into residual.view(-1)
    # q_j dense on its rows, as the dense formula builds it: 0 + each slot's q in slot order.
    q_dense = torch.zeros(B * V, dtype=torch.float64, device=dev).index_add_(0, at, torch.from_numpy(q.ravel()).to(dev))
    res = residual.view(-1)
    res[at] = torch.clamp(res[at] - q_dense[at], min=0.0)  # a duplicate id writes the same number twice
    # Guard: p == q up to rounding leaves no residual mass: sample from p.
    empty = np.flatnonzero(residual.sum(-1).cpu().numpy() <= ZERO_RESIDUAL)
    for b in empty.tolist():
        residual[b] = p_j[b].to(torch.float64)
    return residual


def _draw_host(p: np.ndarray, q_ids: np.ndarray, q: np.ndarray, u: float) -> int:
    """One row's token, drawn on the host: the same numbers as _residual then sampler.sample_from_probs.

    p: [V] the row p_j; q_ids, q: [W] q_j. The residual in float64 (p_j with q_j's support
    rewritten), the guard on its sum (torch's, as there), the left-to-right cumulative sum, the
    first index whose cdf exceeds u * total, and the last token with mass if u * total rounds up
    to the total (the row is rebuilt for that: the cumulative sum overwrites it). One float64 row is made.
    """
    r = _residual_row(p, q_ids, q)  # [V] float64, our own copy
    cdf = torch.from_numpy(r).cumsum_(0).numpy()  # in place (torch's kernel: np.cumsum's sums, ~3x faster)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)):
        raise Internal("a distribution to sample from has no finite positive mass")
    at = int(np.searchsorted(cdf, u * total, side="right"))  # the first cdf > u * total
    if at >= cdf.size:  # u * total rounded up to the total: the last token with mass
        mass = _residual_row(p, q_ids, q) > 0
        at = cdf.size - 1 - int(np.argmax(mass[::-1]))
    return at


def _residual_row(p: np.ndarray, q_ids: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[V] float64: one row of _residual: max(0, p - q), or p where no residual mass is left."""
    r = p.astype(np.float64)  # [V] (a copy)
    live = q > 0  # [W] slots with mass: a zero adds nothing to q_dense
    ids, qv = q_ids[live], q[live]
    seen = np.zeros(r.size, dtype=np.bool_)  # [V]
    seen[ids] = True
    if np.count_nonzero(seen) < ids.size:  # an id twice: q_dense adds them up, in slot order
        ids, where = np.unique(ids, return_inverse=True)
        qv = np.bincount(where, weights=qv, minlength=ids.size)
    r[ids] = np.maximum(r[ids] - qv, 0.0)
    # Guard: p == q up to rounding leaves no residual mass: sample from p (torch's sum, as _residual).
    if not float(torch.from_numpy(r).sum()) > ZERO_RESIDUAL:
        return p.astype(np.float64)
    return r


def _first_bad(bad: np.ndarray, ids: np.ndarray) -> str:
    b, i = (int(v) for v in np.argwhere(bad)[0])
    return f"row {b}, draft {i} has token id {int(ids[b, i])}"
