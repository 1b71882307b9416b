"""`sglang.srt.plugins` entry point `dspark_cpu`: SGLang's torch_native attention, batched, and able to verify.

SGLang's torch_native backend (the attention backend of a CPU without AMX) crashes on TARGET_VERIFY (it reads
extend_prefix_lens, which a verify batch does not set), and its decode runs a Python loop over the requests, one
gather and one SDPA each. A verify step is `draft_token_num` queries per request after `seq_lens` committed tokens; a
decode step is the same with one query. Both run here as one batched attention (`window_attention`): a chain (our
DSPARK worker: no custom mask) attends causally within its window, a token tree (SGLang's NGRAM:
`spec_info.custom_mask`, node j an ancestor of node i) to the whole prefix plus its own ancestors. Prefill and extend
stay on SGLang's own path. Registered only where SGLang runs on a CPU (no CUDA, or SGLANG_USE_CPU_ENGINE set), so a
CUDA server is untouched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from dspark_sgl.sglang.cpu import linear

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def verify_extend_lens(seq_lens: torch.Tensor, draft_token_num: int):
    """(prefix lens, extend lens, kv lens) of a TARGET_VERIFY batch whose committed lengths are seq_lens."""
    extend = seq_lens.new_full(seq_lens.shape, int(draft_token_num))
    return seq_lens, extend, seq_lens + extend


@dataclass
class WindowPlan:
    """What every layer of one DECODE / TARGET_VERIFY forward shares: each request's KV slots, padded to the batch's
    longest, and the mask over them. Built once per forward (`window_plan`), used by each layer (`window_attention`)."""

    slots: torch.Tensor  # [bs, S] pool slots; columns past a request's length are masked
    visible: torch.Tensor  # [bs, w, S] bool
    w: int
    masks: dict = field(default_factory=dict)  # (group, dtype) -> the additive SDPA mask [bs, 1, group*w, S]
    batch: object = None  # the ForwardBatch it was built for

    def mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        key = (group, dtype)
        if key not in self.masks:
            bs, w, S = self.visible.shape
            m = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            m.masked_fill_(~self.visible, float("-inf"))
            self.masks[key] = m.unsqueeze(1).expand(bs, group, w, S).reshape(bs, 1, group * w, S)
        return self.masks[key]


def window_plan(req_to_token, req_pool_indices, kv_lens, w: int, window_mask=None) -> WindowPlan:
    """The slots and mask of every request's last w queries, at positions kv_lens[b]-w .. kv_lens[b]-1 (a decode step:
    w = 1; a verify step: the window after the committed prefix). A query sees the prefix and the window up to itself
    (causal); window_mask [bs, w, w] (bool, [b, i, j] = node j visible to node i) replaces causality within the window
    for a token tree. One gather of req_to_token, padded to the batch's longest."""
    bs = req_pool_indices.shape[0]
    S = int(kv_lens.max())
    slots = req_to_token[req_pool_indices, :S]
    cols = torch.arange(S, device=kv_lens.device).view(1, 1, S)
    start = (kv_lens - w).view(bs, 1, 1).to(cols.dtype)  # position of each request's first window query
    if window_mask is None:
        visible = cols <= start + torch.arange(w, device=kv_lens.device).view(1, w, 1)  # [bs, w, S]
    else:
        in_window = cols - start  # the column's node in the window (negative: the prefix; >= w: padding)
        node = in_window.clamp(0, w - 1).expand(bs, w, S)
        tree = torch.gather(window_mask.view(bs, w, w).bool(), 2, node)
        visible = torch.where(in_window >= 0, tree & (in_window < w), True)
    return WindowPlan(slots, visible, w)


def window_attention(q, k_cache, v_cache, plan: WindowPlan, scaling=None) -> torch.Tensor:
    """One batched SDPA of q [bs*w, heads, d] over the planned slots of the pool's k/v_cache [slots, kv_heads, d]:
    no per-request loop. It runs over [bs, kv_heads, group*w, S]: the query heads that share a KV head sit side by
    side in the query axis, so GQA never copies K/V. Returns [bs*w, heads, dv]."""
    w = plan.w
    bs, heads, d = q.shape[0] // w, q.shape[1], q.shape[2]
    kv_heads, dv = k_cache.shape[1], v_cache.shape[-1]
    group = heads // kv_heads
    k = k_cache[plan.slots].to(q.dtype).transpose(1, 2)  # [bs, kv_heads, S, d]
    v = v_cache[plan.slots].to(q.dtype).transpose(1, 2)
    qg = q.view(bs, w, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * w, d)
    o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask(group, q.dtype), scale=scaling)
    return o.view(bs, kv_heads, group, w, dv).permute(0, 3, 1, 2, 4).reshape(bs * w, heads, dv)


def tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, tree_mask, n: int,
                          scaling=None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of each request's n window nodes [bs*n, heads, d] over its prefix and its window ancestors.

    tree_mask: flat [bs, n, n] bool, [b, i, j] = window node j is visible to node i (itself included). The window's
    keys sit in req_to_token right after the committed prefix (SGLang allocates them there before the verify).
    """
    plan = window_plan(req_to_token, req_pool_indices, seq_lens + n, n, tree_mask)
    return window_attention(q, k_cache, v_cache, plan, scaling)


def _batched(layer, forward_batch) -> bool:
    """What `window_attention` covers: causal decoder self-attention without encoder tokens, sliding window or logit
    cap, with value and key heads of one size (MLA's latent attention keeps SGLang's path). Everything else stays on
    SGLang's own path."""
    from sglang.srt.layers.radix_attention import AttentionType

    window = getattr(layer, "sliding_window_size", None)
    special = (getattr(layer, "is_cross_attention", False),
               getattr(layer, "attn_type", None) == AttentionType.ENCODER_ONLY,
               window is not None and window > -1,
               (getattr(layer, "logit_cap", 0) or 0) > 0,
               getattr(forward_batch, "encoder_lens", None) is not None,
               getattr(layer, "qk_head_dim", None) != getattr(layer, "v_head_dim", None))
    return not any(special)


def make_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class BatchedTorchNativeBackend(TorchNativeAttnBackend):
        """torch_native whose DECODE and TARGET_VERIFY run as one batched attention; prefill/extend unchanged.
        `batched = False` (benchmarks/sglang_verify_cost.py's stock path) routes both through SGLang's own loops;
        `packed_linear` lets the fp32 linears of those forwards use oneDNN's packed weights (linear.py)."""

        batched = True
        packed_linear = True
        packed_linear_now = False  # read by linear.py: this forward is a DECODE or TARGET_VERIFY one

        def __init__(self, model_runner, *args, **kwargs):
            super().__init__(model_runner, *args, **kwargs)
            if self.packed_linear and linear.enabled():  # the weights are loaded: pack before the first request
                linear.pack_model(model_runner.model)

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self._plan = None  # built by the first layer of this forward that needs it
            mode = forward_batch.forward_mode
            self.packed_linear_now = self.packed_linear and (mode.is_decode() or mode.is_target_verify())

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            n = int(forward_batch.spec_info.draft_token_num)
            if not (self.batched and _batched(layer, forward_batch)):
                return self._verify_as_extend(q, k, v, layer, forward_batch, n, save_kv_cache)
            return self._window(q, k, v, layer, forward_batch, save_kv_cache)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not (self.batched and _batched(layer, forward_batch)):
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            return self._window(q, k, v, layer, forward_batch, save_kv_cache)

        def _plan_for(self, forward_batch) -> WindowPlan:
            """This forward's plan; rebuilt when a forward arrives without init_forward_metadata (a new batch)."""
            plan = getattr(self, "_plan", None)
            if plan is None or plan.batch is not forward_batch:
                if forward_batch.forward_mode.is_target_verify():
                    spec = forward_batch.spec_info
                    n = int(spec.draft_token_num)
                    plan = window_plan(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                       forward_batch.seq_lens + n, n, getattr(spec, "custom_mask", None))
                else:
                    plan = window_plan(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                       forward_batch.seq_lens, 1)
                plan.batch = forward_batch
                self._plan = plan
            return plan

        def _window(self, q, k, v, layer, forward_batch, save_kv_cache):
            if save_kv_cache and k is not None and v is not None:
                loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
            o = window_attention(q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                 self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                 self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                                 self._plan_for(forward_batch), layer.scaling)
            return o.reshape(o.shape[0], -1)

        def _verify_as_extend(self, q, k, v, layer, forward_batch, n, save_kv_cache):
            """A chain verify on SGLang's own extend path (layers window_attention does not cover)."""
            prefix, extend, kv_lens = verify_extend_lens(forward_batch.seq_lens, n)
            saved = forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = (
                kv_lens, prefix, extend)
            try:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved

    return BatchedTorchNativeBackend


def serving_on_cpu() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" or not torch.cuda.is_available()


def load() -> None:
    if not serving_on_cpu():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, make_backend_class(), HookType.REPLACE)
    linear.register(HookRegistry, HookType)  # oneDNN-packed fp32 linears in DECODE / TARGET_VERIFY forwards
    from dspark_sgl.sglang.cpu import kda

    kda.register(HookRegistry, HookType)  # KDA + MLA hybrids (Kimi-Linear / K3) on CPU
    from dspark_sgl.sglang.cpu import builtin

    builtin.load()  # test/benchmark harnesses only: SGLang's builtin DSPARK on CPU (DSPARK_SGL_BUILTIN_ON_CPU=1)
