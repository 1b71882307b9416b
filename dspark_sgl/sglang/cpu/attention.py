"""`sglang.srt.plugins` entry point `dspark_cpu`: SGLang's torch_native attention learns the TARGET_VERIFY step.

SGLang's torch_native backend (the attention backend of a CPU without AMX) crashes on TARGET_VERIFY: it reads
extend_prefix_lens, which a verify batch does not set. A verify step is an extend of `draft_token_num` tokens per
request after `seq_lens` committed ones. A chain (our DSPARK worker: no custom mask) attends causally, so we fill
those two fields and reuse the backend's own SDPA extend path; a token tree (SGLang's NGRAM: `spec_info.custom_mask`,
node j an ancestor of node i) attends to the whole prefix plus its own ancestors. Registered only where SGLang runs on
a CPU (no CUDA, or SGLANG_USE_CPU_ENGINE set), so a CUDA server is untouched.
"""

from __future__ import annotations

import os

import torch

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def verify_extend_lens(seq_lens: torch.Tensor, draft_token_num: int):
    """(prefix lens, extend lens, kv lens) of a TARGET_VERIFY batch whose committed lengths are seq_lens."""
    extend = seq_lens.new_full(seq_lens.shape, int(draft_token_num))
    return seq_lens, extend, seq_lens + extend


def tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, tree_mask, n: int,
                          scaling=None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA of each request's n window queries [bs*n, heads, d] over its prefix and its window ancestors.

    tree_mask: flat [bs, n, n] bool, [b, i, j] = window node j is visible to node i (itself included). The window's
    keys sit in req_to_token right after the committed prefix (SGLang allocates them there before the verify).
    """
    out = torch.empty_like(q)
    masks = tree_mask.view(-1, n, n).bool()
    for b, (row, prefix) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        slots = req_to_token[row, : prefix + n]
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        qb = q[b * n : (b + 1) * n].transpose(0, 1)
        visible = torch.cat([masks.new_ones(n, prefix), masks[b]], dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qb, k.to(qb.dtype), v.to(qb.dtype), attn_mask=visible,
                                                             scale=scaling, enable_gqa=enable_gqa)
        out[b * n : (b + 1) * n] = o.transpose(0, 1)
    return out


def make_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class VerifyCapableTorchNativeBackend(TorchNativeAttnBackend):
        """torch_native + TARGET_VERIFY: a chain runs as a causal extend after the prefix, a tree under its mask."""

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            spec = forward_batch.spec_info
            if getattr(spec, "custom_mask", None) is not None:
                return self._tree_verify(q, k, v, layer, forward_batch, spec, save_kv_cache)
            prefix, extend, kv_lens = verify_extend_lens(forward_batch.seq_lens, spec.draft_token_num)
            saved = forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = (
                kv_lens, prefix, extend)
            try:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved

        def _tree_verify(self, q, k, v, layer, forward_batch, spec, save_kv_cache):
            if save_kv_cache and k is not None and v is not None:
                loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
            o = tree_verify_attention(
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                spec.custom_mask, spec.draft_token_num, layer.scaling, layer.tp_q_head_num != layer.tp_k_head_num,
            )
            return o.reshape(q.shape[0], -1)

    return VerifyCapableTorchNativeBackend


def serving_on_cpu() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" or not torch.cuda.is_available()


def load() -> None:
    if not serving_on_cpu():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, make_backend_class(), HookType.REPLACE)
    from dspark_sgl.sglang.cpu import kda

    kda.register(HookRegistry, HookType)  # KDA + MLA hybrids (Kimi-Linear / K3) on CPU
    from dspark_sgl.sglang.cpu import builtin

    builtin.load()  # test/benchmark harnesses only: SGLang's builtin DSPARK on CPU (DSPARK_SGL_BUILTIN_ON_CPU=1)
