"""Fused Markov step: logits = base + W2 · latent, then argmax — one pass over the vocabulary per row.

The greedy rollout does this γ times per block; unfused it materialises a [B, V] bias, adds it, then reads it again
for the argmax. The Triton kernel streams W2 once per row, keeps the running max in registers and writes the logits
only when asked (sampling needs them for q). `markov_step_reference` is the plain-torch definition; the dispatcher
uses the kernel on CUDA when Triton is importable and falls back to the reference everywhere else.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton is optional: CPU installs and CI run the reference (and the kernel under TRITON_INTERPRET=1).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def markov_step_reference(base: Tensor, latent: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
    """base [B, V] fp32, latent [B, r], w2 [V, r] -> (argmax [B] (ties to the lowest id), logits [B, V] fp32).

    The base is added into the bias's own fresh buffer: no third [B, V] tensor (the trainer's loss chunks are
    thousands of rows wide), and `base` is never written."""
    logits = (latent.to(w2.dtype) @ w2.T).float().add_(base)
    return logits.argmax(-1), logits


if triton is not None:

    @triton.jit
    def _markov_step_kernel(
        base_ptr, latent_ptr, w2_ptr, logits_ptr, part_max_ptr, part_idx_ptr,
        V, R, n_blocks,
        stride_base, stride_lat, stride_w2, stride_logits,
        WRITE_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = v < V
        acc = tl.load(base_ptr + row * stride_base + v, mask=vmask, other=float("-inf")).to(tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < R
            lat = tl.load(latent_ptr + row * stride_lat + r, mask=rmask, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + v[:, None] * stride_w2 + r[None, :], mask=vmask[:, None] & rmask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * lat[None, :], axis=1)
        if WRITE_LOGITS:
            tl.store(logits_ptr + row * stride_logits + v, acc, mask=vmask)
        best = tl.max(acc, axis=0)
        idx = tl.argmax(acc, axis=0)  # first maximum: ties go to the lowest id, as torch.argmax
        tl.store(part_max_ptr + row * n_blocks + blk, best)
        tl.store(part_idx_ptr + row * n_blocks + blk, blk * BLOCK_V + idx)

    def markov_step_triton(
        base: Tensor, latent: Tensor, w2: Tensor, write_logits: bool = True, block_v: int = 1024, block_r: int = 64
    ) -> tuple[Tensor, Tensor | None]:
        B, V = base.shape
        R = latent.shape[1]
        base, latent, w2 = base.contiguous(), latent.contiguous(), w2.contiguous()
        n_blocks = triton.cdiv(V, block_v)
        logits = torch.empty(B, V, device=base.device, dtype=torch.float32) if write_logits else base
        part_max = torch.empty(B, n_blocks, device=base.device, dtype=torch.float32)
        part_idx = torch.empty(B, n_blocks, device=base.device, dtype=torch.int64)
        _markov_step_kernel[(B, n_blocks)](
            base, latent, w2, logits, part_max, part_idx, V, R, n_blocks,
            base.stride(0), latent.stride(0), w2.stride(0), logits.stride(0),
            WRITE_LOGITS=write_logits, BLOCK_V=block_v, BLOCK_R=block_r,
        )
        winner = part_max.argmax(-1, keepdim=True)  # lowest block among equal maxima
        return part_idx.gather(1, winner).squeeze(1), (logits if write_logits else None)


def markov_step(
    base: Tensor, latent: Tensor, w2: Tensor, backend: str = "auto", vocab: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Dispatch: "triton" on CUDA (or under TRITON_INTERPRET=1 when forced), "torch" elsewhere.

    With a reduced draft vocabulary base/w2 have K rows and `vocab` [K] maps the winning draft id to its target id
    (the logits stay in draft space: q over the K hot tokens).
    """
    use_triton = backend == "triton" or (backend == "auto" and triton is not None and base.is_cuda)
    if use_triton:
        if triton is None:
            raise RuntimeError("backend='triton' requested but triton is not installed")
        tok, logits = markov_step_triton(base, latent, w2, write_logits=True)
    else:
        tok, logits = markov_step_reference(base, latent, w2)
    return (tok if vocab is None else vocab[tok]), logits
