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
  token from p_K, the position after the last draft.

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

from dataclasses import dataclass

import torch
from torch import Tensor

from specd.core.errors import InvalidArgument
from specd.core.sampling.sampler import Role, coins, sample_from_probs

__all__ = ["SparseProposal", "Verdict", "rejection_sample"]

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


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    proposal: SparseProposal | None,
    seeds: Tensor,
    start_positions: Tensor,
    num_draft: Tensor | None = None,
) -> Verdict:
    """Verify draft tokens against the target's p (see the module docstring).

    target_probs:    [B, K+1, V] float32 processed p at each draft position and one more
    draft_token_ids: [B, K] int64
    proposal:        sparse q per position ([B, K, W]); None => q one-hot at the draft token
    seeds:           [B] int64 request seeds
    start_positions: [B] int64 absolute position of draft token 0 (draft i at start+i)
    num_draft:       [B] int64 real drafts per row (default K); slots >= num_draft[b] are
                     padding: never accepted, q = 0 there, so stopping at i = num_draft[b]
                     draws the bonus from p_i.
    """
    # ---- validate ----
    _require(target_probs.dim() == 3, f"target_probs must be [B, K+1, V], got {tuple(target_probs.shape)}")
    B, K1, V = target_probs.shape
    K = K1 - 1
    _require(K >= 0 and V > 0, f"target_probs must have K+1 >= 1 positions and V >= 1, got {tuple(target_probs.shape)}")
    _require(
        draft_token_ids.shape == (B, K),
        f"draft_token_ids must be [B, K]=[{B}, {K}] to match target_probs, got {tuple(draft_token_ids.shape)}",
    )
    _require(seeds.shape == (B,), f"seeds must be [B]=[{B}], got {tuple(seeds.shape)}")
    _require(start_positions.shape == (B,), f"start_positions must be [B]=[{B}], got {tuple(start_positions.shape)}")
    assert target_probs.is_floating_point(), f"target_probs must be floating point, got {target_probs.dtype}"
    assert not draft_token_ids.is_floating_point() and not seeds.is_floating_point()
    assert not start_positions.is_floating_point()
    dev = target_probs.device
    if num_draft is None:
        num_draft = torch.full((B,), K, dtype=torch.int64, device=dev)
    _require(num_draft.shape == (B,), f"num_draft must be [B]=[{B}], got {tuple(num_draft.shape)}")
    num_draft = num_draft.to(device=dev, dtype=torch.int64)
    _require(bool(((num_draft >= 0) & (num_draft <= K)).all()), f"num_draft must be in [0, K={K}]")
    draft_token_ids = draft_token_ids.to(device=dev, dtype=torch.int64)
    pos_k = torch.arange(K, device=dev)  # [K]
    real = pos_k[None, :] < num_draft[:, None]  # [B, K] real (non-padding) drafts
    bad = real & ((draft_token_ids < 0) | (draft_token_ids >= V))
    if bool(bad.any()):
        raise InvalidArgument(f"draft token ids must be in [0, V={V}): {_first_bad(bad, draft_token_ids)}")
    x = torch.where(real, draft_token_ids, 0)  # [B, K] padding -> a safe id

    p = target_probs  # [B, K+1, V]
    p_x = p[:, :K].gather(-1, x[..., None]).squeeze(-1).to(torch.float64)  # [B, K] p_i(x_i)

    # ---- q_i(x_i) and the dense q at each position ----
    if proposal is None:
        q_x = real.to(torch.float64)  # [B, K] one-hot q: q_i(x_i) = 1
        q_ids = x[..., None]  # [B, K, 1]
        q = q_x[..., None]  # [B, K, 1]
    else:
        q_ids, q_raw = proposal.token_ids, proposal.probs
        _require(
            q_ids.dim() == 3 and q_ids.shape[:2] == (B, K) and q_raw.shape == q_ids.shape,
            f"proposal token_ids and probs must both be [B, K, W] with B={B}, K={K}, "
            f"got {tuple(q_ids.shape)} and {tuple(q_raw.shape)}",
        )
        q_ids = q_ids.to(device=dev, dtype=torch.int64)
        q_raw = q_raw.to(device=dev, dtype=torch.float64)
        _require(bool(((q_ids >= 0) & (q_ids < V)).all()), f"proposal token ids must be in [0, V={V})")
        _require(bool(((q_raw >= 0) & q_raw.isfinite()).all()), "proposal probabilities must be finite and >= 0")
        q_sum = q_raw.sum(-1, keepdim=True)  # [B, K, 1]
        _require(
            not bool((real & (q_sum[..., 0] <= 0)).any()),
            "each real draft position needs a proposal with positive mass",
        )
        # q = wire / sum(wire) in float64 (the draft sampled from exactly this); padding -> 0.
        q = torch.where(real[..., None], q_raw / torch.where(q_sum > 0, q_sum, 1.0), 0.0)  # [B, K, W]
        q_x = (q * (q_ids == x[..., None])).sum(-1)  # [B, K] duplicates add up
        bad = real & (q_x <= 0)
        if bool(bad.any()):
            raise InvalidArgument(
                f"a draft token must be in its own proposal's support (q > 0): {_first_bad(bad, draft_token_ids)}"
            )

    # ---- accept: u < min(1, p(x) / q(x)) ----
    u_acc = coins(seeds, start_positions[:, None] + pos_k[None, :].to(start_positions.device), Role.ACCEPT)
    ratio = p_x / torch.where(real, q_x, 1.0)  # [B, K]
    accepted = real & (u_acc.to(dev) < torch.clamp(ratio, max=1.0))  # [B, K]
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B] leading run of accepts
    is_bonus = num_accepted == num_draft  # [B]
    j = num_accepted  # [B] position of the emitted token

    # ---- recovered / bonus: sample normalise(max(0, p_j - q_j)); q_j = 0 for the bonus ----
    p_j = p.gather(1, j[:, None, None].expand(B, 1, V)).squeeze(1).to(torch.float64)  # [B, V]
    q_dense = torch.zeros_like(p_j)  # [B, V]
    if K > 0:
        jq = torch.clamp(j, max=K - 1)[:, None, None]  # [B, 1, 1] (bonus rows: any, masked below)
        W = q_ids.shape[-1]
        ids_j = q_ids.gather(1, jq.expand(B, 1, W)).squeeze(1)  # [B, W]
        q_j = q.gather(1, jq.expand(B, 1, W)).squeeze(1) * (~is_bonus)[:, None]  # [B, W]
        q_dense.scatter_add_(-1, ids_j, q_j)
    residual = torch.clamp(p_j - q_dense, min=0.0)  # [B, V]
    # Guard: p == q up to rounding leaves no residual mass: sample from p.
    residual = torch.where(residual.sum(-1, keepdim=True) > ZERO_RESIDUAL, residual, p_j)

    pos_j = (start_positions.to(dev) + j)[:, None]  # [B, 1]
    u_rec = coins(seeds, pos_j, Role.RECOVER)[:, 0].to(dev)
    u_bon = coins(seeds, pos_j, Role.BONUS)[:, 0].to(dev)
    next_token = sample_from_probs(residual, torch.where(is_bonus, u_bon, u_rec))  # [B]
    return Verdict(num_accepted=num_accepted, next_token=next_token, is_bonus=is_bonus)


def _first_bad(bad: Tensor, ids: Tensor) -> str:
    b, i = (int(v) for v in bad.nonzero()[0])
    return f"row {b}, draft {i} has token id {int(ids[b, i])}"
