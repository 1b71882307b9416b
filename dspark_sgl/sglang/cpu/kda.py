"""Pure-torch stand-ins for the Triton/CUDA kernels SGLang's KDA (Kimi Delta Attention) hybrid path calls on a CPU.

SGLang 0.5.23 runs a Kimi-Linear / K3 hybrid on CPU only as far as `KDAAttnBackend` + `HybridLinearAttnBackend`: the
KDA recurrences (`TritonKDAKernel`), the prefill conv (`causal_conv1d_fn`), the gated output norm
(`FusedRMSNormGated`) and the post-verify state scatters are Triton or CUDA-only, and the CPU conv update lives in
the missing `sgl_kernel`. Each function here reproduces its Triton counterpart's semantics (read from the kernel
source cited in its docstring), one token at a time, in fp32:

- KDA step (`fused_sigmoid_gating_recurrent.py`, IS_KDA): g = -exp(A_log)·softplus(a + dt_bias) per key channel,
  β = sigmoid(b), q, k l2-normalised (eps 1e-6 under the root), q scaled by K^-1/2; per head h ← h·exp(g)[:, None];
  v ← β·(v − hᵀk); h ← h + k vᵀ; o = hᵀq. The state pool stores h transposed, [slot, head, V, K].
- Conv update (`causal_conv1d_triton.causal_conv1d_update`, chain layout): the window [dim, K−1] slides over each
  token; the persistent window is overwritten with the window after the LAST token (so a verify mutates it), and
  with an intermediate buffer each step's window is saved there.
- State scatters (`mamba_state_scatter_triton.fused_*_scatter_with_mask`): dst[:, d_i] = src[:, i, step_i] for
  step_i >= 0.

`register` installs them (and routes MLA to its absorbed path on torch_native) from the `dspark_cpu` plugin entry
point, on CPU servers only; `sgl_kernel.mamba` (path_sgl_kernel) re-exports the conv update under SGLang's CPU name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


# ---- the KDA recurrence ------------------------------------------------------------------------------------------
def kda_gate(a: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """a [T, H, K] raw forget-gate projection -> log-decay g [T, H, K] (fp32)."""
    H = a.shape[-2]
    x = a.float() + dt_bias.float().view(H, -1)
    A = A_log.float().reshape(H, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * x)
    return -A * F.softplus(x, beta=1.0, threshold=20.0)


def _l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float):
    """One sequence: q, k [T, H, K], v [T, H, V], g [T, H, K] log-decay, beta [T, H] (already sigmoid), state
    [H, V, K] (pool layout). Returns (o [T, H, V], states after each token [T, H, V, K]); inputs are not modified."""
    q, k = _l2norm(q.float()) * scale, _l2norm(k.float())
    h = state.float().transpose(-1, -2).clone()  # [H, K, V]
    outs, states = [], []
    for t in range(q.shape[0]):
        h = h * g[t].float().exp()[..., None]
        v_new = (v[t].float() - torch.einsum("hkv,hk->hv", h, k[t])) * beta[t].float()[:, None]
        h = h + k[t][..., None] * v_new[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", h, q[t]))
        states.append(h.transpose(-1, -2))
    return torch.stack(outs), torch.stack(states)


def _split(cu: Tensor):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class TorchKDAKernel:
    """Drop-in for `TritonKDAKernel`'s decode / target_verify / extend (chain layout, no ReplaySSM ring)."""

    supports_packed_decode = False
    supports_fused_chain_verify = False
    supports_track_state_snapshot = False

    @staticmethod
    def run(q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, lower_bound,
             beta_is_raw=True, update_state=True, intermediate=None, intermediate_indices=None):
        """q, k [1, N, H, K], v [1, N, H, V], a [N, H*K] or [1, N, H, K], b [1, N, H]. Returns o [1, N, H, V]."""
        H, K = q.shape[-2], q.shape[-1]
        a = a.reshape(-1, H, K)
        b = b.reshape(-1, H)
        o = v.new_zeros(v.shape, dtype=torch.float32)
        for i, (s, e) in enumerate(_split(query_start_loc)):
            slot = int(cache_indices[i])
            if slot < 0 or e == s:
                continue
            g = kda_gate(a[s:e], A_log, dt_bias, lower_bound)
            beta = torch.sigmoid(b[s:e].float()) if beta_is_raw else b[s:e].float()
            out, states = kda_steps(q[0, s:e], k[0, s:e], v[0, s:e], g, beta, ssm_states[slot], K ** -0.5)
            o[0, s:e] = out
            if intermediate is not None:
                row = int(intermediate_indices[i])
                intermediate[row, : e - s] = states.to(intermediate.dtype)
            if update_state:
                ssm_states[slot] = states[-1].to(ssm_states.dtype)
        return o.to(v.dtype)

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
               lower_bound=None, **_):
        return TorchKDAKernel.run(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                         cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer, intermediate_state_indices, cache_steps, retrieve_parent_token,
                      lower_bound=None, cache_ring=False, **_):
        if retrieve_parent_token is not None or cache_ring:
            raise NotImplementedError("CPU KDA stand-in: chain verify only (no tree, no ReplaySSM ring)")
        return TorchKDAKernel.run(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                         cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound,
                         update_state=False, intermediate=intermediate_states_buffer,
                         intermediate_indices=intermediate_state_indices)

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None, dt_bias=None,
               lower_bound=None, beta_is_raw=False, return_intermediate_states=False, **_):
        if return_intermediate_states:
            raise NotImplementedError("CPU KDA stand-in: no prefix-cache state tracking (use no_buffer radix)")
        if A_log is None:
            raise NotImplementedError("CPU KDA stand-in: extend expects the raw gate (A_log, dt_bias)")
        return TorchKDAKernel.run(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                         cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound,
                         beta_is_raw=beta_is_raw)


# ---- short convolution -----------------------------------------------------------------------------------------
def _conv_token(window: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool):
    """window [dim, K-1] (oldest first), x [dim] -> (out [dim], next window)."""
    full = torch.cat((window, x[:, None]), 1)
    out = (full.float() * weight.float()).sum(1)
    if bias is not None:
        out = out + bias.float()
    return (F.silu(out) if silu else out), full[:, 1:]


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                         intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None, pad_slot_id=-1, **_):
    """x [B, dim] or [B, dim, T]; conv_state [slots, dim, K-1]; intermediate_conv_window [rows, T, dim, K-1]."""
    if cache_seqlens is not None or num_accept_tokens is not None or retrieve_next_token is not None:
        raise NotImplementedError("CPU conv stand-in: chain layout without circular buffers only")
    silu = activation in (True, "silu", "swish")
    squeeze = x.dim() == 2
    x3 = x[..., None] if squeeze else x
    out = torch.empty_like(x3)
    for i in range(x3.shape[0]):
        slot = i if conv_state_indices is None else int(conv_state_indices[i])
        if slot == pad_slot_id:
            continue
        window = conv_state[slot].clone()
        for t in range(x3.shape[2]):
            o, window = _conv_token(window, x3[i, :, t], weight, bias, silu)
            out[i, :, t] = o.to(out.dtype)
            if intermediate_conv_window is not None:
                intermediate_conv_window[int(intermediate_state_indices[i]), t] = window
        conv_state[slot] = window
    return out[..., 0] if squeeze else out


def causal_conv1d_fn(x, weight, bias=None, activation=None, conv_states=None, has_initial_state=None,
                     cache_indices=None, query_start_loc=None, seq_lens_cpu=None, pad_slot_id=-1, **_):
    """Prefill: x [dim, N] packed by query_start_loc; conv_states [slots, dim, K-1] get each sequence's last window."""
    silu = activation in (True, "silu", "swish")
    out = torch.empty_like(x)
    width = weight.shape[1]
    for i, (s, e) in enumerate(_split(query_start_loc)):
        slot = int(cache_indices[i])
        if slot == pad_slot_id:
            continue
        warm = has_initial_state is not None and bool(has_initial_state[i])
        window = conv_states[slot].clone() if warm else x.new_zeros(x.shape[0], width - 1)
        for t in range(s, e):
            o, window = _conv_token(window, x[:, t], weight, bias, silu)
            out[:, t] = o.to(out.dtype)
        conv_states[slot] = window
    return out


# ---- the gated output norm and the post-verify scatters ----------------------------------------------------------
def rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """FusedRMSNormGated.forward: rmsnorm(x)·weight·act(g) (norm before gate; no residual path)."""
    if residual is not None or prenorm:
        raise NotImplementedError("CPU FusedRMSNormGated stand-in: no residual / prenorm")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    gate = torch.sigmoid(g.float()) if self.activation == "sigmoid" else F.silu(g.float())
    return (y * gate).to(x.dtype)


def state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    """dst [L, slots, ...], src [L, rows, steps, ...]: dst[:, d_i] = src[:, s_i, step_i] where step_i >= 0."""
    n = step_indices_raw.shape[0]
    if n == 0 or dst.numel() == 0:
        return
    src_rows = torch.arange(n) if src_indices_raw is None else src_indices_raw.long().cpu()
    for i, (d, step) in enumerate(zip(dst_indices_raw.long().tolist(), step_indices_raw.long().tolist(),
                                      strict=True)):
        if step < 0 or d < 0 or d >= dst.shape[1] or step >= src.shape[2]:
            continue
        dst[:, d] = src[:, int(src_rows[i]), step]


def conv_window_scatter_multi(pairs, dst_indices_raw, step_indices_raw, dst_indices2_raw=None,
                              step_indices2_raw=None):
    """`fused_conv_window_scatter_multi`: the conv-window scatter over several (dst, src) pairs and up to two index
    sets (the accept commit, then the prefix-cache track slots)."""
    for dst, src in pairs:
        state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw)
        if step_indices2_raw is not None:
            state_scatter_with_mask(dst, src, dst_indices2_raw, step_indices2_raw)


# ---- registration (from attention.load, CPU servers only) ---------------------------------------------------------
KDA_KERNEL = "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel"
SCATTERS = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"


def absorbed_mla(attn, forward_batch):
    """MLA attention method on torch_native: always the absorbed (latent-cache) path. SGLang's default handler picks
    the MHA path for fresh prefills, which passes dense K/V that torch_native ignores (it reads the latent pool)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def register(HookRegistry, HookType) -> None:
    """Replace the Triton/CUDA-only kernels a KDA hybrid's CPU path reaches with the functions above."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    for name in ("decode", "target_verify", "extend"):
        HookRegistry.register(f"{KDA_KERNEL}.{name}", getattr(TorchKDAKernel, name), HookType.REPLACE)
    HookRegistry.register("sglang.srt.layers.attention.linear.kda_backend.causal_conv1d_fn", causal_conv1d_fn,
                          HookType.REPLACE)
    HookRegistry.register("sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward",
                          rms_norm_gated_forward, HookType.REPLACE)
    for name in ("fused_mamba_state_scatter_with_mask", "fused_conv_window_scatter_with_mask"):
        HookRegistry.register(f"{SCATTERS}.{name}", state_scatter_with_mask, HookType.REPLACE)
    HookRegistry.register(f"{SCATTERS}.fused_conv_window_scatter_multi", conv_window_scatter_multi, HookType.REPLACE)
    AttentionBackendRegistry.register("torch_native", absorbed_mla)
