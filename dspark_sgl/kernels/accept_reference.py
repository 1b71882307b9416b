"""Acceptance rules: which draft tokens survive verification, and the bonus token. These torch functions are the
definitions; the fused kernels beside them (dspark_sgl.kernels.accept) are held equal to them.

Notation: draft tokens x [B, γ]; target distributions p [B, γ+1, V] where row j is the target's distribution for the
token after [anchor, x_1..x_j]; draft proposal distributions q [B, γ, V]. `limit` [B] caps how many drafts each
request may accept (the scheduler verifies only a prefix); rows beyond the limit are never read, so a request
with limit L behaves exactly like speculative decoding with γ = L. All three rules are lossless:
  greedy    - T = 0: accept the leading run where x_i = argmax p_{i-1}; bonus = argmax of the next row (the two
              rules below give exactly this when p and q are one-hot, so a mixed batch runs one rule).
  rejection - Leviathan et al.: accept x_i with prob min(1, p/q); on rejection resample from norm(max(p − q, 0)).
  block     - Sun et al. 2024 (arXiv 2403.10444) Alg. 2: judges the block jointly; accepts at least as many tokens
              in expectation as token-wise rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_sgl.kernels.noise import ACCEPT, Noise, as_noise, sample


@dataclass
class Acceptance:
    num_accepted: Tensor  # [B] c: drafts accepted (0..limit)
    bonus: Tensor  # [B] the token the target adds after them


def _limit(limit: Tensor | None, B: int, gamma: int, device) -> Tensor:
    """[B] in 0..γ: a limit above γ is γ, so block's h_L = ρ_L and the full-accept bonus hold there too (the
    kernels in dspark_sgl.kernels.accept cap it the same way)."""
    return torch.full((B,), gamma, device=device, dtype=torch.long) if limit is None else limit.long().clamp(0, gamma)


def _prefix_len(ok: Tensor, limit: Tensor) -> Tensor:
    """Length of the leading run of True in ok [B, γ], capped at limit [B]."""
    return ok.long().cumprod(-1).sum(-1).minimum(limit)


def _pad_q(q: Tensor) -> Tensor:
    """q [B, γ, V] with a zero row appended: after a full accept the bonus comes from p itself (γ may be 0: a verify
    of the anchor alone)."""
    return torch.cat((q, q.new_zeros(q.shape[0], 1, q.shape[-1])), 1)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p − q, 0)), falling back to norm(p) where the residual has no mass (a zero-probability event)."""
    return _normalised_residual((p - q).clamp(min=0), p)


def _normalised_residual(r: Tensor, p: Tensor) -> Tensor:
    """r / Σr, or p / Σp where r has no mass; shared with the fused kernel's path (dspark_sgl.kernels.accept), which
    computes r and leaves this step to torch so that its bonus draw is bit-identical to the reference's."""
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p / p.sum(-1, keepdim=True).clamp(min=1e-30))


def greedy_accept(draft_tokens: Tensor, target_logits: Tensor, limit: Tensor | None = None) -> Acceptance:
    B, gamma = draft_tokens.shape
    y = target_logits.argmax(-1)  # [B, γ+1]
    c = _prefix_len(draft_tokens == y[:, :gamma], _limit(limit, B, gamma, y.device))
    return Acceptance(c, y.gather(1, c[:, None]).squeeze(1))


def rejection_accept(
    draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
    generator: torch.Generator | Noise | None = None,
) -> Acceptance:
    B, gamma = draft_tokens.shape
    noise = as_noise(generator)
    lim = _limit(limit, B, gamma, p.device)
    px = p[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = noise.uniform(B, gamma, ACCEPT, p.device)
    c = _prefix_len(u * qx < px, lim)
    row = p.gather(1, c[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    q_pad = _pad_q(q)
    q_row = q_pad.gather(1, c[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)
    q_row = torch.where((c == lim)[:, None], torch.zeros_like(q_row), q_row)
    return Acceptance(c, sample(_residual(row, q_row), noise))


def block_accept(
    draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
    generator: torch.Generator | Noise | None = None,
) -> Acceptance:
    """Block verification (Sun et al., Alg. 2), vectorised over the batch.

    ρ_0 = 1, ρ_i = min(ρ_{i−1} p_i(x_i) / q_i(x_i), 1); for i < L with 0 < ρ_i < 1,
    h_i = R_i / (R_i + 1 − ρ_i) with R_i = Σ_v max(ρ_i p_{i+1}(v) − q_{i+1}(v), 0), else h_i = ρ_i; h_L = ρ_L.
    Accept the largest i with η_i < h_i (0 if none; strict, so h_i = 0 never accepts);
    bonus ~ norm(max(ρ_c p_{c+1} − q_{c+1}, 0)), or p_{L+1} if c = L.
    """
    B, gamma = draft_tokens.shape
    noise = as_noise(generator)
    lim = _limit(limit, B, gamma, p.device)
    px = p[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    qx = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = torch.where(qx > 0, px / qx.clamp(min=1e-30), torch.zeros_like(px))
    rho = torch.ones(B, gamma + 1, device=p.device)  # rho[:, i] = ρ_i, rho[:, 0] = 1
    for i in range(1, gamma + 1):
        rho[:, i] = (rho[:, i - 1] * ratio[:, i - 1]).clamp(max=1.0)
    q_pad = _pad_q(q)  # [B, γ+1, V]
    # R_i for i = 1..γ uses the next rows p_{i+1} = p[:, i], q_{i+1} = q_pad[:, i]
    R = (rho[:, 1:, None] * p[:, 1:] - q_pad[:, 1:]).clamp(min=0).sum(-1)  # [B, γ]
    r1 = rho[:, 1:]
    h = torch.where((r1 > 0) & (r1 < 1), R / (R + 1 - r1).clamp(min=1e-30), r1)
    idx = torch.arange(1, gamma + 1, device=p.device)
    h = torch.where(idx[None] == lim[:, None], r1, h)  # h_L = ρ_L
    eta = noise.uniform(B, gamma, ACCEPT, p.device)
    ok = (eta < h) & (idx[None] <= lim[:, None])
    c = F.pad(torch.where(ok, idx[None], 0), (1, 0)).amax(-1)  # the largest accepted i, 0 if none (γ may be 0)
    rho_c = rho.gather(1, c[:, None])
    p_row = p.gather(1, c[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    q_row = q_pad.gather(1, c[:, None, None].expand(-1, 1, q.shape[-1])).squeeze(1)
    full = (c == lim)[:, None]
    resid = _residual(rho_c * p_row, torch.where(full, torch.zeros_like(q_row), q_row))
    return Acceptance(c, sample(torch.where(full, p_row, resid), noise))


ACCEPT_RULES = {"rejection": rejection_accept, "block": block_accept}
