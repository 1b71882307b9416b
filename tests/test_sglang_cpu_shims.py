"""The CPU stand-ins that let real SGLang serve on a CPU (dspark_sgl/sglang/cpu), each op against a plain reference.

The kernels, the importable `sgl_kernel` / `torchvision` stand-ins and the verify attention are pure torch, so these
run in any venv; the checks against SGLang's own code (marked `sglang_inprocess`) run in the SGLang venv's python
(`make test-sglang`).
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from dspark_sgl.sglang.cpu import STANDINS, kernels, server_env
from dspark_sgl.sglang.cpu.attention import tree_verify_attention, verify_extend_lens, window_attention, window_plan


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


# Ragged batches for the batched DECODE / TARGET_VERIFY attention: committed lengths, window width, query/KV heads.
WINDOW_CASES = {"decode_b1": ([7], 1, 4, 4), "decode_ragged_gqa": ([1, 9, 4, 13], 1, 6, 2),
                "verify_ragged_gqa": ([5, 12, 1], 4, 6, 2), "verify_w2_mha": ([3, 8], 2, 4, 4),
                "verify_w8_gqa": ([20, 2, 9, 31], 8, 9, 3)}


def _window_batch(seed, lens, w, heads, kv_heads, d=8, slots=512, dtype=torch.float32):
    """Random pool K/V, a req_to_token whose rows hold scattered slots, and queries for w tokens per request."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, d, generator=g).to(dtype)
    rows = torch.tensor([2 * b + 1 for b in range(len(lens))])
    req_to_token = torch.randperm(slots, generator=g)[: 2 * len(lens) * 40].view(2 * len(lens), 40).int()
    q = torch.randn(len(lens) * w, heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, req_to_token, rows, torch.tensor(lens)


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_window_attention_equals_per_request_attention(case):
    """Each request's w queries, one by one, over exactly its prefix and the window up to itself (no mask, no pad)."""
    lens, w, heads, kv_heads = WINDOW_CASES[case]
    q, k_cache, v_cache, req_to_token, rows, committed = _window_batch(0, lens, w, heads, kv_heads)
    kv_lens = committed + (w if w > 1 else 0)  # a decode step's seq_lens already count its one query
    out = window_attention(q, k_cache, v_cache, window_plan(req_to_token, rows, kv_lens, w))
    group = heads // kv_heads
    for b, n in enumerate(kv_lens.tolist()):
        for i in range(w):
            slots = req_to_token[int(rows[b]), : n - w + i + 1]
            k, v = k_cache[slots].repeat_interleave(group, 1), v_cache[slots].repeat_interleave(group, 1)
            att = torch.softmax(torch.einsum("hd,khd->hk", q[b * w + i], k) / 8**0.5, -1)
            torch.testing.assert_close(out[b * w + i], torch.einsum("hk,khd->hd", att, v), atol=1e-6, rtol=1e-5)


class _Pool:
    """The token-to-KV pool surface the torch_native backend touches: one layer's K/V buffers."""

    def __init__(self, k_cache, v_cache):
        self.k, self.v = k_cache, v_cache

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs):
        loc = getattr(loc, "loc", loc)
        self.k[loc], self.v[loc] = k.view(-1, *self.k.shape[1:]), v.view(-1, *self.v.shape[1:])


def _backends(pool, req_to_token):
    """SGLang's stock torch_native backend and ours (the plugin's REPLACE class), wired to the same pool."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from dspark_sgl.sglang.cpu.attention import make_backend_class

    out = []
    for cls in (TorchNativeAttnBackend, make_backend_class()):
        backend = cls.__new__(cls)
        backend.token_to_kv_pool, backend.swa_out_cache_loc = pool, None
        backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
        backend.forward_metadata, backend.use_sliding_window_kv_pool = None, False
        out.append(backend)
    return out


@pytest.mark.sglang_inprocess
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_batched_backend_equals_sglangs_torch_native(on_path, case):
    """DECODE against SGLang's own decode loop; a chain TARGET_VERIFY against SGLang's own SDPA extend over the window
    after the prefix (what the stock path computes once it knows the prefix); the new K/V written first, as SGLang's."""
    on_path("sgl_kernel"), on_path("torchvision")
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lens, w, heads, kv_heads = WINDOW_CASES[case]
    q, k_cache, v_cache, req_to_token, rows, committed = _window_batch(1, lens, w, heads, kv_heads)
    d, bs = q.shape[-1], len(lens)
    g = torch.Generator().manual_seed(7)
    k_new, v_new = torch.randn(bs * w, kv_heads * d, generator=g), torch.randn(bs * w, kv_heads * d, generator=g)
    layer = SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=kv_heads, qk_head_dim=d, v_head_dim=d, layer_id=0,
                            scaling=d**-0.5, is_cross_attention=False, attn_type=AttentionType.DECODER,
                            sliding_window_size=-1, logit_cap=0.0)
    verify = w > 1
    kv_lens = committed + w if verify else committed
    window = torch.arange(w)[None] + (kv_lens - w)[:, None]  # [bs, w] positions of the new tokens
    loc = torch.stack([req_to_token[int(r), window[b]] for b, r in enumerate(rows)]).view(-1).long()
    outs = []
    for backend in _backends(None, req_to_token):
        backend.token_to_kv_pool = _Pool(k_cache.clone(), v_cache.clone())
        fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE,
                             spec_info=SimpleNamespace(draft_token_num=w, custom_mask=None), seq_lens=committed,
                             seq_lens_cpu=committed, req_pool_indices=rows, out_cache_loc=loc, encoder_lens=None)
        stock = type(backend).__name__ == "TorchNativeAttnBackend"
        if stock and verify:
            prefix, extend, kv = verify_extend_lens(committed, w)
            fb.seq_lens, fb.seq_lens_cpu, fb.extend_prefix_lens, fb.extend_seq_lens = kv, kv, prefix, extend
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = prefix.tolist(), extend.tolist()
            fb.forward_mode = ForwardMode.EXTEND
        elif not verify:
            fb.seq_lens = fb.seq_lens_cpu = kv_lens
        backend.init_forward_metadata(fb)
        run = backend.forward_extend if verify else backend.forward_decode
        outs.append(run(q.reshape(bs * w, -1), k_new, v_new, layer, fb))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)


# ---- packed linears ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_packed_linear_equals_f_linear_and_follows_weight_updates(rows):
    """oneDNN's packed fp32 linear (dspark_sgl/sglang/cpu/linear.py) against F.linear; an in-place weight update (what
    a live weight update does) must reach it, not a stale packed copy."""
    from dspark_sgl.sglang.cpu.linear import packed_linear

    g = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(64, 96)
    x = torch.randn(rows, 3, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(packed_linear(x, layer, layer.bias), torch.nn.functional.linear(x, layer.weight,
                                   layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight.mul_(-0.5)
        torch.testing.assert_close(packed_linear(x, layer), x @ layer.weight.T, atol=1e-5, rtol=1e-5)


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


@pytest.mark.sglang_inprocess
def test_the_backend_packs_the_models_linears_before_the_first_forward(on_path, monkeypatch):
    """Packed on first use, a server's first multi-row step paid for packing every layer (a 872 ms step against a
    107 ms median, stop 52): the attention backend packs them when it starts, exactly those a DECODE / TARGET_VERIFY
    forward would take (SGLang's unquantized fp32 linears and the lm_head), and a forward then uses that copy."""
    on_path("sgl_kernel"), on_path("torchvision")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from dspark_sgl.sglang.cpu import linear
    from dspark_sgl.sglang.cpu.attention import make_backend_class

    model = torch.nn.Module()
    model.qkv, model.own = torch.nn.Linear(16, 32), torch.nn.Linear(8, 8)
    model.bf16 = torch.nn.Linear(16, 32).bfloat16()
    model.qkv.quant_method = model.bf16.quant_method = UnquantizedLinearMethod()  # `own`: not SGLang's linear
    model.lm_head = torch.nn.Embedding(50, 16)  # a tied head: the embedding's weight
    monkeypatch.setattr(TorchNativeAttnBackend, "__init__", lambda self, model_runner: None)  # needs a whole runner
    monkeypatch.setenv(linear.ENV, "1")
    make_backend_class()(SimpleNamespace(model=model))
    assert {n for n, m in model.named_children() if hasattr(m, "_dspark_packed")} == {"qkv", "lm_head"}
    made = model.qkv._dspark_packed
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(linear.packed_linear(x, model.qkv, model.qkv.bias), model.qkv(x), atol=1e-5,
                                   rtol=1e-5)
    assert model.qkv._dspark_packed is made  # no second packing in the forward
    monkeypatch.setenv(linear.ENV, "0")  # switched off: nothing is packed
    fresh = torch.nn.Linear(16, 32)
    fresh.quant_method = UnquantizedLinearMethod()
    make_backend_class()(SimpleNamespace(model=torch.nn.Sequential(fresh)))
    assert not hasattr(fresh, "_dspark_packed")
