"""Test-only SGLang plugin: teach the torch_native attention backend the TARGET_VERIFY step (CPU CI).

SGLang's torch_native backend crashes on TARGET_VERIFY (it reads extend_prefix_lens, which a verify batch does not
set). A verify step is just an extend of `draft_token_num` tokens per request after `seq_lens` committed ones, with
plain causal attention, so we fill those two fields and reuse the backend's own SDPA extend path. This is what
routes verify-capable attention on a CPU with no AMX; it ships in the test tree (PYTHONPATH=tests/sglang_cpu, found
through the dist-info beside it), never in the product.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def verify_extend_lens(seq_lens, draft_token_num: int):
    """(prefix lens, extend lens, kv lens) of a TARGET_VERIFY batch whose committed lengths are seq_lens."""
    extend = seq_lens.new_full(seq_lens.shape, int(draft_token_num))
    return seq_lens, extend, seq_lens + extend


def make_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class VerifyCapableTorchNativeBackend(TorchNativeAttnBackend):
        """torch_native + TARGET_VERIFY: a verify batch runs as a causal extend after the committed prefix."""

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            prefix, extend, kv_lens = verify_extend_lens(
                forward_batch.seq_lens, forward_batch.spec_info.draft_token_num
            )
            saved = forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = (
                kv_lens,
                prefix,
                extend,
            )
            try:
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            finally:
                forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens = saved

    return VerifyCapableTorchNativeBackend


def load() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, make_backend_class(), HookType.REPLACE)
    logger.info("dspark CPU shims: torch_native attention now runs TARGET_VERIFY (test-only plugin)")
