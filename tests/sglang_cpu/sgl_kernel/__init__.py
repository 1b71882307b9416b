"""Pure-torch stand-in for `sgl_kernel` so real SGLang runs on a CPU without AMX (tests only).

PyPI ships no CPU build of sgl_kernel. Only the ops SGLang reaches on the CPU paths we test are
implemented, each beside a plain-torch reference in tests/test_sglang_cpu_shims.py. Any other name
resolves to a stub that raises on call, so an unexpected kernel shows up as one clear error.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+dspark-cpu-standin"


def _runs(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(request row, its token span, the matching span of the flat out_cache_loc) for each request."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        yield row, slice(start, end), slice(offset, offset + end - start)
        offset += end - start


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    del pool_len  # a row stride for the C++ kernel; the tensor knows its shape
    for row, span, flat in _runs(req_pool_indices, start_offset, end_offset):
        req_to_token[row, span] = out_cache_loc[flat].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The inverse gather: out_cache_loc's i-th run = req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    del pool_len
    for row, span, flat in _runs(req_pool_indices, start_offset, end_offset):
        out_cache_loc[flat] = req_to_token[row, span].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer b (raw address data_ptrs[b], row size strides[b] bytes): row tgt[i] = row src[i].

    All source rows are read before any is written, like the tiled Triton kernel, so in-place moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    rows = int(max(tgt_loc.max(), src_loc.max())) + 1
    tgt, src = tgt_loc.long().cpu(), src_loc.long().cpu()
    for addr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(addr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing on the right copies first


class _Missing:
    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not in the CPU stand-in (tests/sglang_cpu/sgl_kernel)"
        )


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
