"""The dense formulas the fast paths must reproduce: specd's sampler code before the host paths (issue 29).

Kept verbatim (less validation) so that tests can check, number for number, that the host-side
versions in specd.core.sampling (sparse_q.build's selection and rounding, the rejection sampler's
accept test and residual) compute what these do, on crafted, random and adversarial inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specd.core.sampling.rejection import ZERO_RESIDUAL, SparseProposal, Verdict
from specd.core.sampling.sampler import Role, coins, token_coins
from specd.core.sampling.sparse_q import QSettings


def build(probs: Tensor, settings: QSettings) -> tuple[Tensor, Tensor]:
    """sparse_q.build as a full top-k over each row, then the mass rule and the rounding, all in torch."""
    V = probs.shape[-1]
    k = min(settings.max_tokens, V)
    total = probs.to(torch.float64).sum(-1, keepdim=True)  # [A, 1]
    vals, ids = torch.topk(probs, k, dim=-1)  # [A, k]
    v64 = vals.to(torch.float64)
    keep = vals > 0
    if settings.epsilon > 0:
        before = torch.cumsum(v64, dim=-1) - v64
        keep &= before < (1.0 - settings.epsilon) * total
    keep[:, 0] = True
    kept = torch.where(keep, v64, 0.0)
    t = kept / kept.sum(-1, keepdim=True)
    weights = torch.round(t * float(1 << settings.bits))
    weights[:, 0] = torch.clamp(weights[:, 0], min=1.0)
    width = max(1, int((weights > 0).sum(-1).max()))
    weights, ids = weights[:, :width], ids[:, :width]
    ids = torch.where(weights > 0, ids, 0)
    return ids.to(torch.int64), weights.to(torch.float32)


def rejection_sample(
    p: Tensor, draft_token_ids: Tensor, proposal: SparseProposal | None, seeds: Tensor, start: Tensor, num_draft: Tensor
) -> Verdict:
    """rejection.rejection_sample over dense [B, V] rows: the accept test, q_dense, the residual, the guard."""
    B, K1, V = p.shape
    K = K1 - 1
    pos_k = torch.arange(K)
    real = pos_k[None, :] < num_draft[:, None]  # [B, K]
    x = torch.where(real, draft_token_ids, 0)
    p_x = p[:, :K].gather(-1, x[..., None]).squeeze(-1).to(torch.float64)
    if proposal is None:
        q_x = real.to(torch.float64)
        q_ids = x[..., None]
        q = q_x[..., None]
    else:
        q_ids, q_raw = proposal.token_ids, proposal.probs.to(torch.float64)
        q_sum = q_raw.sum(-1, keepdim=True)
        q = torch.where(real[..., None], q_raw / torch.where(q_sum > 0, q_sum, 1.0), 0.0)
        q_x = (q * (q_ids == x[..., None])).sum(-1)
    u_acc = coins(seeds, start[:, None] + pos_k[None, :], Role.ACCEPT)
    ratio = p_x / torch.where(real, q_x, 1.0)
    accepted = real & (u_acc < torch.clamp(ratio, max=1.0))
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)
    is_bonus = num_accepted == num_draft
    j = num_accepted
    p_j = p.gather(1, j[:, None, None].expand(B, 1, V)).squeeze(1).to(torch.float64)
    q_dense = torch.zeros_like(p_j)
    if K > 0:
        jq = torch.clamp(j, max=K - 1)[:, None, None]
        W = q_ids.shape[-1]
        ids_j = q_ids.gather(1, jq.expand(B, 1, W)).squeeze(1)
        q_j = q.gather(1, jq.expand(B, 1, W)).squeeze(1) * (~is_bonus)[:, None]
        q_dense.scatter_add_(-1, ids_j, q_j)
    residual = torch.clamp(p_j - q_dense, min=0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > ZERO_RESIDUAL, residual, p_j)
    pos_j = (start + j)[:, None]
    u_rec = coins(seeds, pos_j, Role.RECOVER)[:, 0]
    next_token = sample_from_probs(residual, u_rec)
    for b in torch.nonzero(is_bonus).flatten().tolist():
        next_token[b] = bonus_race(p_j[b], int(seeds[b]), int(pos_j[b, 0]))
    return Verdict(num_accepted=num_accepted, next_token=next_token, is_bonus=is_bonus)


def bonus_race(p: Tensor, seed: int, position: int, head_share: float = 2.0**-10) -> int:
    """The bonus token of a dense row p [V] (weights >= 0), from the race's definition
    (specd.core.sampling.bonus_race): a clock E / p per head token (p >= head_share of the mass,
    E = -log(1 - U) of its own coin), one clock E_T / m_T for the tail; the first to ring wins, and
    a ringing tail draws its token by inverse CDF over the tail with the bonus coin."""
    w = p.to(torch.float64)
    head = w >= head_share * w.sum()
    ids = torch.arange(w.numel())
    clock = torch.full_like(w, float("inf"))
    if bool(head.any()):
        u = torch.from_numpy(token_coins(seed, position, Role.BONUS_RACE, ids[head].numpy()))
        clock[head] = -torch.log1p(-u) / w[head]
    tail = torch.where(head, 0.0, w)
    if float(tail.sum()) > 0:
        u_tail = coins(torch.tensor([seed]), torch.tensor([[position]]), Role.BONUS_TAIL)[0, 0]
        if float(-torch.log1p(-u_tail) / tail.sum()) < float(clock.min()):
            u = coins(torch.tensor([seed]), torch.tensor([[position]]), Role.BONUS)[:, 0]
            return int(sample_from_probs(tail[None], u)[0])
    return int(torch.argmin(clock))


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """sampler.sample_from_probs with its fall-back computed for every row (the last token with weight > 0)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    total = cdf[..., -1]
    target = (u.to(torch.float64) * total).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    V = probs.shape[-1]
    last_pos = (V - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_pos).to(torch.int64)
