"""Pure-torch CPU versions of the `sgl_kernel` ops real SGLang 0.5.23 reaches when it serves on a CPU.

PyPI ships no CPU build of `sgl_kernel` (its wheel needs libcuda). These are the ops plain decoding, our DSPARK worker
and SGLang's NGRAM worker call on the CPU path, written from the contracts of SGLang's own Triton kernels
(`sglang/kernels/ops/speculative/{cache_locs,eagle,spec_tree,reconstruct_tree}.py`). Each is tested against a plain
reference in tests/test_sglang_cpu_shims.py. The importable `sgl_kernel` package (path_sgl_kernel/) re-exports them;
this module itself imports only torch.
"""

from __future__ import annotations

import ctypes

import torch


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


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Pack out_cache_loc[i] for every accepted index i (row-major, -1 = none) to the front of accept_out_cache_loc."""
    src = accept_index.reshape(-1)
    src = src[src != -1].long()
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    last = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long().cpu() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last])


# ---- NGRAM: token trees ----------------------------------------------------------------------------------------
def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Verify metadata of a draft tree, in place. tree_mask[b, i, j] (flat, row-major) marks node j an ancestor of i.

    positions = depth + verified length; retrieve_index = b*n + node; next_token = the first child;
    next_sibling = the next node with the same parent (-1 for the root and for the last child).
    """
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    node = torch.arange(n)
    anc = tree_mask[: bs * n * n].view(bs, n, n).bool().cpu() & (node[None, :] < node[:, None])  # strict ancestors
    positions.view(-1)[: bs * n].copy_((anc.sum(-1) + verified_seq_len[:bs].long().cpu()[:, None]).reshape(-1))
    retrieve_index.view(bs, n).copy_(torch.arange(bs)[:, None] * n + node)
    parent = torch.where(anc, node, -1).amax(-1)  # [bs, n]; the deepest ancestor is the parent
    first_child = torch.where(anc, node[None, :, None], n).amin(1)  # over rows k: smallest k with tid as ancestor
    retrieve_next_token.view(bs, n).copy_(torch.where(first_child < n, first_child, -1))
    later_sibling = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :])  # [b, k, tid]
    first_sibling = torch.where(later_sibling, node[None, :, None], n).amin(1)
    retrieve_next_sibling.view(bs, n).copy_(torch.where((parent >= 0) & (first_sibling < n), first_sibling, -1))


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verify, in place: walk from the root, at each level take the child equal to the target's argmax.

    predicts[node] = target token after every accepted node (and the bonus after the last); accept_index[b] lists
    the accepted nodes' global indices, root first (the caller fills it with -1); accept_token_num[b] = accepted
    drafts, bonus excluded. Argument names follow the sgl_kernel op schema (`retrive_*`).
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()  # indexed by global node index b*n + node
    writes: dict[int, int] = {}
    for b in range(bs):
        last, path, cur = index[b][0], [index[b][0]], 0
        for _ in range(1, steps):
            cur = next_token[b][cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = next_sibling[b][cur]
            if cur == -1:
                break
            writes[last] = target[last]
            last = index[b][cur]
            path.append(last)
        writes[last] = target[last]
        accept_index[b, : len(path)] = torch.tensor(path, dtype=accept_index.dtype)
        accept_token_num[b] = len(path) - 1
    if writes:
        predicts[torch.tensor(list(writes))] = torch.tensor(list(writes.values()), dtype=predicts.dtype)
