"""Fused acceptance on CUDA: the greedy, rejection and block rules of dspark_sgl.kernels.accept_reference as Triton
kernels.

The torch functions in accept_reference.py are the definitions; the CPU path runs them and the tests hold each kernel
(under TRITON_INTERPRET=1) to equality with them. Each kernel is one program per request row:

    greedy    - walks the verify rows j = 0, 1, ... computing argmax over V in BLOCK_V chunks and stops at the first
                mismatch (or the limit), so a request that accepts c drafts reads c + 1 rows of logits, not γ + 1,
                and no [B, γ+1] argmax tensor is materialised.
    rejection - the accept test u·q(x) < p(x) in float64 (the reference's promotion, so c is bit-identical), then
                one pass over V writing the residual max(p_c − q_c, 0) of the stop row (q_c = 0 after a full
                accept), without the reference's [B, γ+1, V] copy of q and its gathers. Normalising that residual and
                the inverse-CDF draw stay in torch (the reference's own helpers): a blocked sum in the kernel would
                round the mass differently from torch's, and then the bonus could differ from the reference's in
                rare draws; with torch doing them the bonus is bit-identical on the same noise.
    block     - ρ_1..ρ_L in one scalar pass over the drafts (kept in registers), then i = L, L−1, ... downwards to
                the first i with η_i < h_i: that is the largest such i, which is c, so the scan stops early and a
                pass over V for R_i is made only where i < L and 0 < ρ_i < 1 (h_L = ρ_L needs none). Then, as in
                rejection, one pass writes the stop row's residual max(ρ_c p_{c+1} − q_{c+1}, 0) and torch draws the
                bonus. R_i is summed in float64 and rounded: its order differs from torch's sum (as torch's CPU and
                CUDA sums differ from each other), so c can differ from the reference's only when η_i lies within
                an ulp of h_i; everything else (ρ, the divisions, the residual row) is the reference's fp32
                arithmetic, bit for bit, given the same c.

A reduced draft vocabulary passes `d2t` [K] (EAGLE-3 convention: draft id i is target id i + d2t[i]) with draft
tokens in draft ids; the kernels map them on load, the torch path maps them before calling the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_sgl.kernels.accept_reference import (
    Acceptance,
    _normalised_residual,
    block_accept,
    greedy_accept,
    rejection_accept,
)
from dspark_sgl.kernels.noise import ACCEPT, Noise, as_noise, sample

try:  # Triton is optional: CPU installs and CI run the reference (and the kernels under TRITON_INTERPRET=1).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def target_ids(draft_tokens: Tensor, d2t: Tensor | None) -> Tensor:
    """Draft-vocabulary ids -> target ids (i + d2t[i]); the identity without a reduced vocabulary."""
    return draft_tokens if d2t is None else draft_tokens + d2t.to(draft_tokens.device)[draft_tokens]


def _limits(limit: Tensor | None, B: int, gamma: int, device) -> Tensor:
    """int32 [B] in 0..γ: the reference caps c at min(limit, γ) too (a limit above γ is γ)."""
    if limit is None:
        return torch.full((B,), gamma, device=device, dtype=torch.int32)
    return limit.to(device).long().clamp(0, gamma).to(torch.int32).contiguous()


if triton is not None:

    @triton.jit
    def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
        """argmax of one row of V logits, ties to the lowest id (torch.argmax): strict > keeps the earlier block,
        tl.argmax keeps the first maximum inside a block."""
        best_val = float("-inf")
        best_idx = 0
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            i = v0 + tl.argmax(x, axis=0)
            take = m > best_val
            best_idx = tl.where(take, i, best_idx)
            best_val = tl.where(take, m, best_val)
        return best_idx

    @triton.jit
    def _draft_id(draft_ptr, d2t_ptr, j, HAS_D2T: tl.constexpr):
        """Draft token j of this row as a target id."""
        x = tl.load(draft_ptr + j).to(tl.int64)
        if HAS_D2T:
            x += tl.load(d2t_ptr + x).to(tl.int64)
        return x

    @triton.jit
    def _greedy_kernel(
        logits_ptr, draft_ptr, d2t_ptr, limit_ptr, num_ptr, bonus_ptr,
        V, stride_lb, stride_lj, stride_db,
        HAS_D2T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        lim = tl.load(limit_ptr + b)
        row_ptr = logits_ptr + b * stride_lb
        j = tl.zeros_like(lim)
        tok = 0
        go = lim >= 0  # always true; a tensor so that the loop below runs on device values
        while go:  # row j: accept x_{j+1} while it is the argmax and j < limit, else its argmax is the bonus
            tok = _row_argmax(row_ptr + j * stride_lj, V, BLOCK_V)
            go = j < lim
            if go:
                go = _draft_id(draft_ptr + b * stride_db, d2t_ptr, j, HAS_D2T) == tok
            j += go.to(tl.int32)
        tl.store(num_ptr + b, j.to(tl.int64))
        tl.store(bonus_ptr + b, tok.to(tl.int64))

    @triton.jit
    def _rejection_kernel(
        p_ptr, q_ptr, u_ptr, draft_ptr, d2t_ptr, limit_ptr, num_ptr, resid_ptr,
        V, stride_pb, stride_pj, stride_qb, stride_qj, stride_ub, stride_db, stride_rb,
        HAS_D2T: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        lim = tl.load(limit_ptr + b)
        p_row = p_ptr + b * stride_pb
        q_row = q_ptr + b * stride_qb
        j = tl.zeros_like(lim)
        go = j < lim
        while go:  # accept x_{j+1} with prob min(1, p/q): u·q < p in float64, as the reference's promotion
            x = _draft_id(draft_ptr + b * stride_db, d2t_ptr, j, HAS_D2T)
            px = tl.load(p_row + j * stride_pj + x).to(tl.float64)
            qx = tl.load(q_row + j * stride_qj + x).to(tl.float64)
            ok = tl.load(u_ptr + b * stride_ub + j) * qx < px
            j += ok.to(tl.int32)
            go = ok & (j < lim)
        tl.store(num_ptr + b, j.to(tl.int64))
        q_len = tl.where(j < lim, V, 0)  # after a full accept (c = limit) q_c = 0: the bonus comes from p itself
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            pv = tl.load(p_row + j * stride_pj + v, mask=v < V, other=0.0)
            qv = tl.load(q_row + j * stride_qj + v, mask=v < q_len, other=0.0)
            tl.store(resid_ptr + b * stride_rb + v, tl.maximum(pv - qv, 0.0), mask=v < V)

    @triton.jit
    def _block_kernel(
        p_ptr, q_ptr, u_ptr, draft_ptr, d2t_ptr, limit_ptr, num_ptr, rho_ptr, resid_ptr,
        V, stride_pb, stride_pj, stride_qb, stride_qj, stride_ub, stride_db, stride_rb,
        HAS_D2T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_G: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        lim = tl.load(limit_ptr + b)
        p_row = p_ptr + b * stride_pb
        q_row = q_ptr + b * stride_qb
        g = tl.arange(0, BLOCK_G)
        rho = tl.where(g == 0, 1.0, 0.0)  # rho[i] = ρ_i; a register vector, as a scalar loop cannot index an array
        r = tl.full((), 1.0, tl.float32)
        j = tl.zeros_like(lim)
        while j < lim:  # ρ_{j+1} = min(ρ_j · p(x)/q(x), 1), the ratio 0 where q(x) = 0, exactly as the reference
            x = _draft_id(draft_ptr + b * stride_db, d2t_ptr, j, HAS_D2T)
            px = tl.load(p_row + j * stride_pj + x).to(tl.float32)
            qx = tl.load(q_row + j * stride_qj + x).to(tl.float32)
            ratio = tl.where(qx > 0, tl.math.div_rn(px, tl.maximum(qx, 1e-30)), 0.0)  # div_rn: IEEE, as torch
            r = tl.minimum(r * ratio, 1.0)
            j += 1
            rho = tl.where(g == j, r, rho)
        c = tl.zeros_like(lim)
        i = lim
        go = i > 0
        while go:  # downwards: the first i with η_i < h_i is the largest, i.e. c
            rho_i = tl.sum(tl.where(g == i, rho, 0.0), axis=0)
            h = rho_i  # h_L = ρ_L, and h_i = ρ_i where ρ_i is 0 or 1
            if (i < lim) & (rho_i > 0) & (rho_i < 1):  # h_i = R_i / (R_i + 1 − ρ_i), R_i over p_{i+1}, q_{i+1}
                acc = tl.zeros([BLOCK_V], dtype=tl.float64)
                for v0 in range(0, V, BLOCK_V):
                    v = v0 + tl.arange(0, BLOCK_V)
                    pv = tl.load(p_row + i * stride_pj + v, mask=v < V, other=0.0).to(tl.float32)
                    qv = tl.load(q_row + i * stride_qj + v, mask=v < V, other=0.0).to(tl.float32)
                    acc += tl.maximum(rho_i * pv - qv, 0.0).to(tl.float64)
                R = tl.sum(acc, axis=0).to(tl.float32)
                h = tl.math.div_rn(R, tl.maximum(R + 1.0 - rho_i, 1e-30))
            ok = tl.load(u_ptr + b * stride_ub + i - 1) < h.to(tl.float64)  # strict: h_i = 0 never accepts
            c = tl.where(ok, i, c)
            i -= 1
            go = (c == 0) & (i > 0)
        rho_c = tl.sum(tl.where(g == c, rho, 0.0), axis=0)
        tl.store(num_ptr + b, c.to(tl.int64))
        tl.store(rho_ptr + b, rho_c)
        q_len = tl.where(c < lim, V, 0)  # after a full accept q_{c+1} = 0 (the bonus then comes from p_{L+1} itself)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            pv = tl.load(p_row + c * stride_pj + v, mask=v < V, other=0.0).to(tl.float32)
            qv = tl.load(q_row + c * stride_qj + v, mask=v < q_len, other=0.0).to(tl.float32)
            tl.store(resid_ptr + b * stride_rb + v, tl.maximum(rho_c * pv - qv, 0.0), mask=v < V)

    def greedy_accept_triton(
        draft_tokens: Tensor, target_logits: Tensor, limit: Tensor | None = None, d2t: Tensor | None = None,
        block_v: int = 1024,
    ) -> Acceptance:
        """draft_tokens [B, γ] (draft ids if d2t is given), target_logits [B, ≥γ+1, V] -> greedy_accept's result."""
        B, gamma = draft_tokens.shape
        V = target_logits.shape[-1]
        logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
        draft = draft_tokens.contiguous()
        num = torch.empty(B, device=logits.device, dtype=torch.int64)
        bonus = torch.empty_like(num)
        _greedy_kernel[(B,)](
            logits, draft, draft if d2t is None else d2t.contiguous(), _limits(limit, B, gamma, logits.device),
            num, bonus, V, logits.stride(0), logits.stride(1), max(draft.stride(0), 1),
            HAS_D2T=d2t is not None, BLOCK_V=block_v,
        )
        return Acceptance(num, bonus)

    def rejection_prefix_triton(
        draft_tokens: Tensor, q: Tensor, p: Tensor, u: Tensor, limit: Tensor | None = None,
        d2t: Tensor | None = None, block_v: int = 1024,
    ) -> tuple[Tensor, Tensor]:
        """The kernel alone: (c [B], residual max(p_c − q_c, 0) [B, V] fp32, unnormalised) for accept uniforms
        u [B, γ] float64. p [B, γ+1, V] and q [B, γ, V] fp32, as the reference computes in."""
        B, gamma = draft_tokens.shape
        V = p.shape[-1]
        p, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (p, q))
        draft, u = draft_tokens.contiguous(), u.to(torch.float64).contiguous()
        num = torch.empty(B, device=p.device, dtype=torch.int64)
        resid = torch.empty(B, V, device=p.device, dtype=torch.float32)
        q_arg = q if gamma > 0 else p  # γ = 0: q has no rows and is never read (c = limit = 0)
        _rejection_kernel[(B,)](
            p, q_arg, u, draft, draft if d2t is None else d2t.contiguous(), _limits(limit, B, gamma, p.device),
            num, resid, V, p.stride(0), p.stride(1), q_arg.stride(0), q_arg.stride(1), max(u.stride(0), 1),
            max(draft.stride(0), 1), resid.stride(0),
            HAS_D2T=d2t is not None, BLOCK_V=block_v,
        )
        return num, resid

    def rejection_accept_triton(
        draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
        generator: torch.Generator | Noise | None = None, d2t: Tensor | None = None, block_v: int = 1024,
    ) -> Acceptance:
        """rejection_accept's result on the same noise: the accept uniforms are drawn here exactly as the reference
        draws them (same stream, same order), the kernel finds c and the residual, torch normalises and draws."""
        B, gamma = draft_tokens.shape
        noise = as_noise(generator)
        u = noise.uniform(B, gamma, ACCEPT, p.device)
        c, resid = rejection_prefix_triton(draft_tokens, q, p, u, limit, d2t, block_v)
        p_row = p[torch.arange(B, device=p.device), c].float()
        return Acceptance(c, sample(_normalised_residual(resid, p_row), noise))

    def block_prefix_triton(
        draft_tokens: Tensor, q: Tensor, p: Tensor, u: Tensor, limit: Tensor | None = None,
        d2t: Tensor | None = None, block_v: int = 1024,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel alone: (c [B], ρ_c [B] fp32, residual max(ρ_c p_{c+1} − q_{c+1}, 0) [B, V] fp32, unnormalised)
        for accept uniforms u [B, γ] float64. p [B, γ+1, V] and q [B, γ, V] fp32."""
        B, gamma = draft_tokens.shape
        V = p.shape[-1]
        p, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (p, q))
        draft, u = draft_tokens.contiguous(), u.to(torch.float64).contiguous()
        num = torch.empty(B, device=p.device, dtype=torch.int64)
        rho = torch.empty(B, device=p.device, dtype=torch.float32)
        resid = torch.empty(B, V, device=p.device, dtype=torch.float32)
        q_arg = q if gamma > 0 else p  # γ = 0: q has no rows and is never read (c = limit = 0)
        _block_kernel[(B,)](
            p, q_arg, u, draft, draft if d2t is None else d2t.contiguous(), _limits(limit, B, gamma, p.device),
            num, rho, resid, V, p.stride(0), p.stride(1), q_arg.stride(0), q_arg.stride(1), max(u.stride(0), 1),
            max(draft.stride(0), 1), resid.stride(0),
            HAS_D2T=d2t is not None, BLOCK_V=block_v, BLOCK_G=triton.next_power_of_2(gamma + 1),
            enable_fp_fusion=False,  # ρ·p − q as two roundings, as torch computes it (an FMA would round once)
        )
        return num, rho, resid

    def block_accept_triton(
        draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
        generator: torch.Generator | Noise | None = None, d2t: Tensor | None = None, block_v: int = 1024,
    ) -> Acceptance:
        """block_accept's result on the same noise: the η are drawn here as the reference draws them, the kernel
        finds c, ρ_c and the residual, and torch finishes the bonus with the reference's own steps (the residual
        normalised, falling back to ρ_c p_{c+1}; p_{L+1} itself after a full accept)."""
        B, gamma = draft_tokens.shape
        noise = as_noise(generator)
        u = noise.uniform(B, gamma, ACCEPT, p.device)
        c, rho_c, resid = block_prefix_triton(draft_tokens, q, p, u, limit, d2t, block_v)
        p_row = p[torch.arange(B, device=p.device), c].float()
        full = (c == _limits(limit, B, gamma, p.device))[:, None]
        probs = torch.where(full, p_row, _normalised_residual(resid, rho_c[:, None] * p_row))
        return Acceptance(c, sample(probs, noise))


def _use_triton(backend: str, *tensors: Tensor) -> bool:
    use = backend == "triton" or (backend == "auto" and triton is not None and all(t.is_cuda for t in tensors))
    if use and triton is None:
        raise RuntimeError("backend='triton' requested but triton is not installed")
    return use


def _use_sampled_kernel(backend: str, draft_tokens: Tensor, q: Tensor, p: Tensor) -> bool:
    """The rejection and block kernels by default only for fp32 p and q: the dtype the references' arithmetic is
    defined in (in bf16 the reference's ratios round differently); "triton" forces them."""
    fp32 = p.dtype == torch.float32 and q.dtype == torch.float32
    return (backend == "triton" or fp32) and _use_triton(backend, draft_tokens, q, p)


def greedy_accept_dispatch(
    draft_tokens: Tensor, target_logits: Tensor, limit: Tensor | None = None, d2t: Tensor | None = None,
    backend: str = "auto",
) -> Acceptance:
    """greedy_accept: the kernel on CUDA when Triton imports ("triton" forces it), the torch reference elsewhere."""
    if _use_triton(backend, draft_tokens, target_logits):
        return greedy_accept_triton(draft_tokens, target_logits, limit, d2t)
    return greedy_accept(target_ids(draft_tokens, d2t), target_logits, limit)


def rejection_accept_dispatch(
    draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
    generator: torch.Generator | Noise | None = None, d2t: Tensor | None = None, backend: str = "auto",
) -> Acceptance:
    """rejection_accept: the kernel on CUDA for fp32 p and q, the torch reference elsewhere."""
    if _use_sampled_kernel(backend, draft_tokens, q, p):
        return rejection_accept_triton(draft_tokens, q, p, limit, generator, d2t)
    return rejection_accept(target_ids(draft_tokens, d2t), q, p, limit, generator)


def block_accept_dispatch(
    draft_tokens: Tensor, q: Tensor, p: Tensor, limit: Tensor | None = None,
    generator: torch.Generator | Noise | None = None, d2t: Tensor | None = None, backend: str = "auto",
) -> Acceptance:
    """block_accept: the kernel on CUDA for fp32 p and q, the torch reference elsewhere (as rejection's)."""
    if _use_sampled_kernel(backend, draft_tokens, q, p):
        return block_accept_triton(draft_tokens, q, p, limit, generator, d2t)
    return block_accept(target_ids(draft_tokens, d2t), q, p, limit, generator)
