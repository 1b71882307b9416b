"""Hybrid (KDA) recurrent state after a verify step: the commit keeps exactly the accepted prefix.

A tiny KDA layer's state pool (SSM state + short-conv window per slot) is verified over γ+1 tokens by the CPU
stand-in of SGLang's KDA verify kernel (dspark_sgl/sglang/cpu/kda.py: per-step states into the speculative scratch,
the persistent conv window slid over the whole window, as the Triton kernels do). The worker's commit step indices
(dspark_sgl.sglang.hybrid.commit_step_indices, fed to SGLang's update_mamba_state_after_mtp_verify) then scatter
the accepted step back, the way SGLang's scatter kernels do. The committed state must equal a naive delta-rule
recurrence (written here in matrix form, independently of the stand-in) over exactly the first c+1 tokens, for
several c in one batch, on permuted pool slots. Fast and torch-only: runs in the default suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dspark_sgl.sglang.cpu.kda import TorchKDAKernel, causal_conv1d_update, kda_gate, state_scatter_with_mask
from dspark_sgl.sglang.hybrid import commit_step_indices, preserve_state

H, DK, DV, KW = 2, 8, 6, 4  # heads, key dim, value dim, conv width
DIM = 2 * H * DK + H * DV  # conv channels: q, k, v


@dataclass(frozen=True)
class SpecState:  # the fields of SGLang's MambaPool.SpeculativeState this layer uses ([layers=1, ...])
    conv: list
    temporal: torch.Tensor
    intermediate_ssm: torch.Tensor
    intermediate_conv_window: list


def make_pool(slots: int, rows: int, steps: int, gen: torch.Generator) -> SpecState:
    return SpecState(conv=[torch.randn(1, slots, DIM, KW - 1, generator=gen)],
                     temporal=torch.randn(1, slots, H, DV, DK, generator=gen) * 0.3,
                     intermediate_ssm=torch.zeros(1, rows, steps, H, DV, DK),
                     intermediate_conv_window=[torch.zeros(1, rows, steps, DIM, KW - 1)])


def make_layer(gen: torch.Generator) -> dict:
    return dict(conv_w=torch.randn(DIM, KW, generator=gen) * 0.5, conv_b=torch.randn(DIM, generator=gen) * 0.1,
                A_log=torch.randn(1, 1, H, 1, generator=gen) * 0.3, dt_bias=torch.randn(H * DK, generator=gen))


def reference(layer: dict, conv_window, ssm, x, a, b):
    """Process tokens one by one from the definition: short conv (+SiLU), then per head with S [K, V]
    S <- (I - β k kᵀ) diag(exp g) S + β k vᵀ (q, k l2-normalised, q scaled by K^-1/2). Returns (window, S [H,V,K])."""
    window = conv_window.clone()
    S = ssm.transpose(-1, -2).clone()  # [H, K, V]
    for t in range(x.shape[0]):
        full = torch.cat((window, x[t][:, None]), 1)
        y = torch.nn.functional.silu((full * layer["conv_w"]).sum(1) + layer["conv_b"])
        window = full[:, 1:]
        q, k, v = y.split([H * DK, H * DK, H * DV])
        g = kda_gate(a[t].view(1, H, DK), layer["A_log"], layer["dt_bias"])[0]
        beta = torch.sigmoid(b[t])
        for h in range(H):
            kh = k.view(H, DK)[h]
            kh = kh / torch.sqrt(kh @ kh + 1e-6)
            decay = torch.diag(g[h].exp())
            S[h] = (torch.eye(DK) - beta[h] * torch.outer(kh, kh)) @ decay @ S[h] + beta[h] * torch.outer(
                kh, v.view(H, DV)[h])
    return window, S.transpose(-1, -2)


def verify(layer: dict, pool: SpecState, slots: torch.Tensor, x, a, b) -> None:
    """SGLang's KDA verify order: conv update with per-step windows, then the recurrence with per-step states."""
    bs, W = x.shape[:2]
    rows = torch.arange(bs)
    conv_out = causal_conv1d_update(x.transpose(1, 2), pool.conv[0][0], layer["conv_w"], layer["conv_b"],
                                    activation="silu", conv_state_indices=slots,
                                    intermediate_conv_window=pool.intermediate_conv_window[0][0],
                                    intermediate_state_indices=rows)
    qkv = conv_out.transpose(1, 2).reshape(bs * W, DIM)
    q, k, v = qkv.split([H * DK, H * DK, H * DV], -1)
    TorchKDAKernel().target_verify(
        layer["A_log"], layer["dt_bias"], q.view(1, -1, H, DK), k.view(1, -1, H, DK), v.view(1, -1, H, DV),
        a.reshape(bs * W, H * DK), b.reshape(1, bs * W, H), ssm_states=pool.temporal[0], cache_indices=slots,
        query_start_loc=torch.arange(bs + 1) * W, intermediate_states_buffer=pool.intermediate_ssm[0],
        intermediate_state_indices=rows, cache_steps=W, retrieve_parent_token=None)


def commit(pool: SpecState, slots, steps) -> None:
    """SGLang's scatter_mamba_states_after_mtp_verify without tracking: state at each request's step -> its slot."""
    state_scatter_with_mask(pool.temporal, pool.intermediate_ssm, slots, steps)
    state_scatter_with_mask(pool.conv[0], pool.intermediate_conv_window[0], slots, steps)


def inputs(bs: int, W: int, gen):
    return (torch.randn(bs, W, DIM, generator=gen), torch.randn(bs, W, H * DK, generator=gen),
            torch.randn(bs, W, H, generator=gen))


@pytest.mark.parametrize("off_by", [0, 1])
def test_commit_equals_sequential_processing_of_accepted_prefix(off_by):
    gen = torch.Generator().manual_seed(0)
    gamma, slots = 5, torch.tensor([5, 2, 7, 0])
    W, bs = gamma + 1, len(slots)
    layer, pool = make_layer(gen), make_pool(8, bs, gamma + 1, gen)
    before = (pool.conv[0][0].clone(), pool.temporal[0].clone())
    x, a, b = inputs(bs, W, gen)
    commit_lens = torch.tensor([1, 3, 6, 4])  # accepted drafts c = 0, 2, 5, 3 (+1 anchor each)

    verify(layer, pool, slots, x, a, b)
    last, track = commit_step_indices(commit_lens, torch.tensor([9, 17, 30, 4]), None)
    assert track is None and last.tolist() == [0, 2, 5, 3]
    commit(pool, slots, torch.clamp(last + off_by, max=gamma))  # off_by=1: the planted bug (one step too far)

    exact = []
    for r, slot in enumerate(slots.tolist()):
        n = int(commit_lens[r])
        window, ssm = reference(layer, before[0][slot], before[1][slot], x[r, :n], a[r, :n], b[r, :n])
        exact.append(torch.allclose(pool.conv[0][0, slot], window, atol=1e-6)
                     and torch.allclose(pool.temporal[0, slot], ssm, atol=1e-5))
    if off_by == 0:
        assert exact == [True] * bs
    else:  # the request that accepted everything (c = γ) is clamped back onto its right step
        assert exact == [False, False, True, False]
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(pool.temporal[0, untouched], before[1][untouched])


def test_track_step_lands_on_the_interval_boundary():
    """With the mamba radix cache's extra buffer, the tracked step is the one whose post-state sits at a multiple of
    the track interval (state after token index step = committed length pre + step + 1)."""
    interval, pre = 8, torch.tensor([5, 6, 7, 8, 14, 0])
    commit_lens = torch.tensor([3, 2, 2, 8, 1, 8])
    last, track = commit_step_indices(commit_lens, pre, interval)
    assert last.tolist() == (commit_lens - 1).tolist()
    for r in range(len(pre)):
        hits = [s for s in range(int(commit_lens[r])) if (int(pre[r]) + s + 1) % interval == 0]
        assert int(track[r]) == (hits[-1] if hits else -1)


def test_probe_verifies_leave_hybrid_state_as_found():
    """A verify slides the persistent conv window over the whole window (not idempotent): two probe verifies inside
    preserve_state leave every tensor as found; the same verifies outside it would not."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([3, 1])
    layer, pool = make_layer(gen), make_pool(4, 2, 6, gen)
    x, a, b = inputs(2, 6, gen)
    snapshot = [t.clone() for t in (pool.conv[0], pool.temporal, pool.intermediate_ssm)]
    with preserve_state(pool, slots, torch.arange(2)):
        verify(layer, pool, slots, x, a, b)
        verify(layer, pool, slots, x[:, :3], a[:, :3], b[:, :3])
    assert all(torch.equal(t, s) for t, s in zip((pool.conv[0], pool.temporal, pool.intermediate_ssm), snapshot,
                                                    strict=True))
    verify(layer, pool, slots, x, a, b)
    assert not torch.equal(pool.conv[0], snapshot[0])
