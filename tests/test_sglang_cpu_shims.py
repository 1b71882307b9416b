"""The CPU stand-ins that let real SGLang serve on a CPU (dspark_sgl/sglang/cpu), each op against a plain reference.

The kernels, the importable `sgl_kernel` / `torchvision` stand-ins and the verify attention are pure torch, so these
run in any venv; the checks against SGLang's own code (marked `sglang_inprocess`) run in the SGLang venv's python
(`make test-sglang`).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from dspark_sgl.sglang.cpu import STANDINS, kernels, server_env
from dspark_sgl.sglang.cpu.attention import tree_verify_attention, verify_extend_lens


@pytest.fixture
def on_path():
    """Put stand-in folders on sys.path for one test; forget every module imported from them afterwards."""
    added = []

    def add(name: str):
        sys.path.insert(0, str(STANDINS[name]))
        added.append(name)
        return importlib.import_module(name)

    yield add
    for name in added:
        sys.path.remove(str(STANDINS[name]))
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def _runs(starts, ends):
    return [torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]


# ---- cache-location ops -------------------------------------------------------------------------------------------
def test_assign_req_to_token_pool_matches_reference():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 32, dtype=torch.int32)
    rows, starts, ends = torch.tensor([4, 1, 3]), torch.tensor([0, 5, 9]), torch.tensor([7, 6, 17])
    out_cache_loc = torch.randint(1, 1000, (int((ends - starts).sum()),), generator=g)
    expected = req_to_token.clone()
    offset = 0
    for r, span in zip(rows.tolist(), _runs(starts, ends), strict=True):
        expected[r, span] = out_cache_loc[offset : offset + len(span)].int()
        offset += len(span)
    kernels.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 32)
    assert torch.equal(req_to_token, expected)


def test_assign_extend_cache_locs_is_the_inverse_gather():
    req_to_token = torch.arange(6 * 32, dtype=torch.int32).view(6, 32)
    rows, starts = torch.tensor([2, 0, 5]), torch.tensor([3, 0, 30])
    ends = starts + 2
    out = torch.empty(6, dtype=torch.int64)
    kernels.assign_extend_cache_locs_cpu(rows, req_to_token, starts, ends, out, 32)
    expected = torch.cat([req_to_token[r, s:e] for r, s, e in zip(rows, starts, ends, strict=True)]).long()
    assert torch.equal(out, expected)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer():
    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(16, 3, 4, generator=g), torch.randn(16, 8, generator=g).half()]
    ref = [b.clone() for b in bufs]
    tgt, src = torch.tensor([2, 3, 7]), torch.tensor([3, 7, 2])  # overlapping: a rotation, reads before writes
    for b in ref:
        b[tgt] = b[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref, strict=True):
        assert torch.equal(b, r)


def test_fill_accept_out_cache_loc_packs_accepted_slots_in_order():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109)
    packed = torch.full((9,), -7, dtype=torch.int64)
    kernels.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, packed)
    assert packed.tolist() == [100, 102, 104, 106, 107, 108, -7, -7, -7]


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token():
    accept_tokens = torch.tensor([11, 12, 13, 21, 22, 23, 31, 32, 33])
    bonus = torch.zeros(3, dtype=torch.int64)
    kernels.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 1, 3], dtype=torch.int32), bonus, 3)
    assert bonus.tolist() == [12, 21, 33]


# ---- NGRAM token trees --------------------------------------------------------------------------------------------
# Two requests, n = 6 nodes each. Request 0: 0 -> {1, 2}, 1 -> {3, 5}, 2 -> {4}. Request 1: a chain 0-1-2-3-4-5.
PARENTS = [[-1, 0, 0, 1, 2, 1], [-1, 0, 1, 2, 3, 4]]


def _tree_mask(parents: list[list[int]]) -> torch.Tensor:
    """mask[b, i, j] = node j is node i or one of its ancestors (what SGLang's NGRAM corpus hands the worker)."""
    n = len(parents[0])
    mask = torch.zeros(len(parents), n, n, dtype=torch.bool)
    for b, par in enumerate(parents):
        for i in range(n):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = par[j]
    return mask


def _reference_links(parents):
    """From the parent lists directly: depth, first child, next sibling (the op's documented contract)."""
    depth, first_child, next_sibling = [], [], []
    for par in parents:
        n = len(par)
        d = [0] * n
        for i in range(1, n):
            d[i] = d[par[i]] + 1
        depth.append(d)
        first_child.append([next((k for k in range(n) if par[k] == i), -1) for i in range(n)])
        next_sibling.append([-1 if par[i] < 0 else next((k for k in range(i + 1, n) if par[k] == par[i]), -1)
                             for i in range(n)])
    return depth, first_child, next_sibling


def _reconstruct(parents, seq_lens):
    bs, n = len(parents), len(parents[0])
    positions = torch.full((bs * n,), -9, dtype=torch.int64)
    index, nxt, sib = (torch.full((bs, n), -9, dtype=torch.int64) for _ in range(3))
    kernels.reconstruct_indices_from_tree_mask(_tree_mask(parents).flatten(), seq_lens, positions, index, nxt, sib,
                                               bs, n)
    return positions, index, nxt, sib


def test_reconstruct_indices_from_tree_mask_matches_the_parent_lists():
    seq_lens = torch.tensor([10, 3])
    positions, index, nxt, sib = _reconstruct(PARENTS, seq_lens)
    depth, first_child, next_sibling = _reference_links(PARENTS)
    assert positions.view(2, 6).tolist() == [[d + int(s) for d in ds] for ds, s in zip(depth, seq_lens, strict=True)]
    assert index.tolist() == [list(range(6)), list(range(6, 12))]
    assert nxt.tolist() == first_child
    assert sib.tolist() == next_sibling
    assert sib[0].tolist() == [-1, 2, -1, 5, -1, -1]  # spelled out once: 1 and 2 share the root, 3 and 5 share 1


@pytest.mark.sglang_inprocess
def test_reconstruct_indices_agrees_with_sglangs_host_derivation(on_path):
    on_path("sgl_kernel"), on_path("torchvision")  # what a CPU server process gets (this venv has neither)
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    _, _, nxt, sib = _reconstruct(PARENTS, torch.tensor([5, 5]))
    ref_next, ref_sib = _derive_tree_links(_tree_mask(PARENTS).numpy(), 2, 6)
    assert torch.equal(nxt, ref_next) and torch.equal(sib, ref_sib)


def _greedy_reference(parents, candidates, target):
    """Walk the tree by hand: follow the child whose token equals the target's argmax after the current node."""
    out = []
    for b, par in enumerate(parents):
        node, path = 0, [0]
        while True:
            child = next((k for k in range(len(par)) if par[k] == node and candidates[b][k] == target[b][node]), None)
            if child is None:
                break
            node = child
            path.append(node)
        out.append(path)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_verify_tree_greedy_accepts_the_matching_path(seed):
    g = torch.Generator().manual_seed(seed)
    bs, n = 2, 6
    candidates = torch.randint(0, 3, (bs, n), generator=g)  # a 3-token vocabulary: many partial matches
    target = torch.randint(0, 3, (bs, n), generator=g)
    _, index, nxt, sib = _reconstruct(PARENTS, torch.tensor([4, 4]))
    predicts = torch.full((bs * n,), -5, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    kernels.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index, nxt, sib, target)
    for b, path in enumerate(_greedy_reference(PARENTS, candidates.tolist(), target.tolist())):
        glob = [b * n + node for node in path]
        assert accept_index[b].tolist() == glob + [-1] * (n - len(path))
        assert int(accept_num[b]) == len(path) - 1
        for node in path:  # after every accepted node: the target's own next token (the last one is the bonus)
            assert int(predicts[b * n + node]) == int(target[b, node])
        untouched = set(range(n)) - set(path)
        assert all(int(predicts[b * n + k]) == -5 for k in untouched)


def test_verify_tree_greedy_planted_mismatch_stops_the_walk():
    """The chain request with every draft equal to the target's next token accepts all 5; flip one and it stops."""
    chain = [PARENTS[1]]
    target = torch.tensor([[7, 8, 9, 10, 11, 12]])
    candidates = torch.tensor([[0, 7, 8, 9, 10, 11]])
    _, index, nxt, sib = _reconstruct(chain, torch.tensor([1]))

    def accepted(cands):
        acc, num = torch.full((1, 6), -1, dtype=torch.int32), torch.empty(1, dtype=torch.int32)
        kernels.verify_tree_greedy_cpu(torch.zeros(6, dtype=torch.int32), acc, num, cands, index, nxt, sib, target)
        return int(num[0])

    assert accepted(candidates) == 5
    candidates[0, 3] = 0
    assert accepted(candidates) == 2


# ---- the importable stand-ins and when they are used --------------------------------------------------------------
def test_sgl_kernel_standin_exports_the_ops_and_names_a_missing_one(on_path):
    sgl_kernel = on_path("sgl_kernel")
    assert sgl_kernel.verify_tree_greedy_cpu is kernels.verify_tree_greedy_cpu
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    assert reconstruct_indices_from_tree_mask is kernels.reconstruct_indices_from_tree_mask
    with pytest.raises(NotImplementedError, match="some_cuda_only_op"):
        sgl_kernel.some_cuda_only_op(torch.zeros(1))


def test_torchvision_standin_imports_but_never_works(on_path):
    on_path("torchvision")
    import torchvision.transforms.functional as F
    from torchvision.io import ImageReadMode  # noqa: F401 - what transformers imports at module level
    from torchvision.transforms import InterpolationMode

    assert InterpolationMode.BICUBIC.value == "bicubic"
    with pytest.raises(NotImplementedError, match="import-only"):
        F.resize(torch.zeros(1), 2)


def test_server_env_adds_a_standin_only_where_the_real_module_does_not_import(tmp_path):
    """This venv has no sgl_kernel: the stand-in goes first on PYTHONPATH. A real (here: fake) one keeps it off."""
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    paths = server_env(sys.executable, base)["PYTHONPATH"].split(":")
    assert str(STANDINS["sgl_kernel"]) in paths
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("")
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("")
    env = server_env(sys.executable, {**base, "PYTHONPATH": str(tmp_path)})
    assert env["PYTHONPATH"] == str(tmp_path) and env["SGLANG_USE_CPU_ENGINE"] == "1"


# ---- verify attention -----------------------------------------------------------------------------------------------
def _kv(g, slots=64, heads=2, d=8):
    return torch.randn(slots, heads, d, generator=g), torch.randn(slots, heads, d, generator=g)


def test_tree_verify_attention_sees_the_prefix_and_exactly_its_ancestors():
    """Against attention computed on the gathered keys (prefix + ancestors) only, per node: no mask involved."""
    g = torch.Generator().manual_seed(3)
    n, heads, d = 6, 2, 8
    k_cache, v_cache = _kv(g)
    req_to_token = torch.randperm(64, generator=g)[: 2 * 24].view(2, 24)
    seq_lens, rows = torch.tensor([9, 4]), torch.tensor([1, 0])
    q = torch.randn(2 * n, heads, d, generator=g)
    mask = _tree_mask(PARENTS)
    out = tree_verify_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, mask.flatten(), n)
    for b in range(2):
        prefix = int(seq_lens[b])
        for i in range(n):
            cols = list(range(prefix)) + [prefix + j for j in range(n) if mask[b, i, j]]
            slots = req_to_token[int(rows[b]), cols]
            w = torch.softmax(torch.einsum("hd,khd->hk", q[b * n + i], k_cache[slots]) / d**0.5, -1)
            ref = torch.einsum("hk,khd->hd", w, v_cache[slots])
            torch.testing.assert_close(out[b * n + i], ref)


@pytest.mark.sglang_inprocess
def test_verify_attention_chain_is_causal_extend_after_the_prefix(on_path):
    """The chain route (DSPARK, no custom mask) reuses SGLang's SDPA extend; a chain tree mask must agree with it."""
    on_path("sgl_kernel"), on_path("torchvision")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    g = torch.Generator().manual_seed(2)
    heads, d, window = 2, 8, 4
    seq_lens = torch.tensor([5, 3])
    prefix, extend, kv_lens = verify_extend_lens(seq_lens, window)
    k_cache, v_cache = _kv(g)
    req_to_token = torch.randperm(64, generator=g)[: 2 * 16].view(2, 16)
    q = torch.randn(2 * window, heads, d, generator=g)
    out = torch.empty_like(q)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_extend(q, out, k_cache, v_cache, req_to_token, torch.tensor([0, 1]), kv_lens, prefix,
                                     extend, causal=True)
    chain = torch.tril(torch.ones(window, window, dtype=torch.bool)).expand(2, -1, -1).flatten()
    tree = tree_verify_attention(q, k_cache, v_cache, req_to_token, torch.tensor([0, 1]), seq_lens, chain, window)
    torch.testing.assert_close(tree, out)
    for b in range(2):
        n = int(kv_lens[b])
        k = k_cache[req_to_token[b, :n]].transpose(0, 1)
        v = v_cache[req_to_token[b, :n]].transpose(0, 1)
        qb = q[b * window : (b + 1) * window].transpose(0, 1)
        mask = torch.arange(n)[None] <= (int(prefix[b]) + torch.arange(window))[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[b * window : (b + 1) * window], ref)


def test_builtin_harness_shim_is_off_without_its_switch_and_skips_record_stream_on_cpu(monkeypatch):
    """dspark_sgl/sglang/cpu/builtin.py (SGLang's builtin DSPARK on CPU, tests and benchmarks only) patches nothing
    unless DSPARK_SGL_BUILTIN_ON_CPU=1; its record_stream is a no-op where torch's has no CPU kernel."""
    from dspark_sgl.sglang.cpu import builtin

    monkeypatch.delenv(builtin.ENV, raising=False)
    before = torch.Tensor.record_stream
    builtin.load()
    assert torch.Tensor.record_stream is before
    with pytest.raises(RuntimeError):
        torch.zeros(3).record_stream(torch.cpu.current_stream())
    assert builtin.record_stream(torch.zeros(3), torch.cpu.current_stream()) is None
