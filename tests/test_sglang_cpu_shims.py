"""The CPU stand-ins that let real SGLang run here (tests/sglang_cpu), each op against a plain torch reference.

The sgl_kernel and torchvision stand-ins are pure torch, so these run in any venv; the attention check needs sglang.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

STANDINS = Path(__file__).resolve().parent / "sglang_cpu"


@pytest.fixture(scope="module")
def sgl_kernel():
    sys.path.insert(0, str(STANDINS))
    try:
        yield importlib.import_module("sgl_kernel")
    finally:
        sys.path.remove(str(STANDINS))


def _runs(starts, ends):
    return [torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]


def test_assign_req_to_token_pool_matches_reference(sgl_kernel):
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 32, dtype=torch.int32)
    rows, starts, ends = torch.tensor([4, 1, 3]), torch.tensor([0, 5, 9]), torch.tensor([7, 6, 17])
    out_cache_loc = torch.randint(1, 1000, (int((ends - starts).sum()),), generator=g)
    expected = req_to_token.clone()
    offset = 0
    for r, span in zip(rows.tolist(), _runs(starts, ends), strict=True):
        expected[r, span] = out_cache_loc[offset : offset + len(span)].int()
        offset += len(span)
    sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 32)
    assert torch.equal(req_to_token, expected)


def test_assign_extend_cache_locs_is_the_inverse_gather(sgl_kernel):
    req_to_token = torch.arange(6 * 32, dtype=torch.int32).view(6, 32)
    rows, starts = torch.tensor([2, 0, 5]), torch.tensor([3, 0, 30])
    ends = starts + 2
    out = torch.empty(6, dtype=torch.int64)
    sgl_kernel.assign_extend_cache_locs_cpu(rows, req_to_token, starts, ends, out, 32)
    expected = torch.cat([req_to_token[r, s:e] for r, s, e in zip(rows, starts, ends, strict=True)]).long()
    assert torch.equal(out, expected)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer(sgl_kernel):
    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(16, 3, 4, generator=g), torch.randn(16, 8, generator=g).half()]
    ref = [b.clone() for b in bufs]
    tgt, src = torch.tensor([2, 3, 7]), torch.tensor([3, 7, 2])  # overlapping: a rotation, reads before writes
    for b in ref:
        b[tgt] = b[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref, strict=True):
        assert torch.equal(b, r)


def test_unknown_op_fails_loudly_with_its_name(sgl_kernel):
    with pytest.raises(NotImplementedError, match="some_cuda_only_op"):
        sgl_kernel.some_cuda_only_op(torch.zeros(1))


def test_torchvision_standin_imports_but_never_works():
    sys.path.insert(0, str(STANDINS))
    try:
        import torchvision.transforms.functional as F
        from torchvision.io import ImageReadMode  # noqa: F401 - what transformers imports at module level
        from torchvision.transforms import InterpolationMode

        assert InterpolationMode.BICUBIC.value == "bicubic"
        with pytest.raises(NotImplementedError, match="import-only"):
            F.resize(torch.zeros(1), 2)
    finally:
        sys.path.remove(str(STANDINS))
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]


def test_verify_attention_is_causal_extend_after_the_prefix():
    """The TARGET_VERIFY route (sglang_cpu_shims) against plain causal SDPA over prefix + window."""
    pytest.importorskip("sglang", reason="needs real SGLang (the sglang venv from .ci/install_sglang.sh)")
    sys.path.insert(0, str(STANDINS))
    try:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang_cpu_shims import verify_extend_lens
    finally:
        sys.path.remove(str(STANDINS))
    g = torch.Generator().manual_seed(2)
    heads, d, window = 2, 8, 4
    seq_lens = torch.tensor([5, 3])
    prefix, extend, kv_lens = verify_extend_lens(seq_lens, window)
    slots = 64
    k_cache, v_cache = torch.randn(slots, heads, d, generator=g), torch.randn(slots, heads, d, generator=g)
    req_to_token = torch.randperm(slots, generator=g)[:2 * 16].view(2, 16)
    q = torch.randn(2 * window, heads, d, generator=g)
    out = torch.empty_like(q)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_extend(q, out, k_cache, v_cache, req_to_token, torch.tensor([0, 1]), kv_lens, prefix,
                                     extend, causal=True)
    for b in range(2):
        n = int(kv_lens[b])
        k = k_cache[req_to_token[b, :n]].transpose(0, 1)
        v = v_cache[req_to_token[b, :n]].transpose(0, 1)
        qb = q[b * window : (b + 1) * window].transpose(0, 1)
        mask = torch.arange(n)[None] <= (int(prefix[b]) + torch.arange(window))[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[b * window : (b + 1) * window], ref)
