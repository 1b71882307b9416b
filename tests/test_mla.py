"""The MLA-native draft (Inferact/Kimi-K3-DSpark, cards 000/002/003) on a tiny layout: config layout round trip,
vLLM weight names, training forward == inference forward, the latent cache is the whole context (absorbed == unabsorbed
attention), lossless T = 0 in the reference engine, the SGLang worker's pool, the cards' quantization tensor lists,
the dflash+MLA GGUF, drift, and the K3 parameter counts next to the cards' figures."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_sgl.config import ConfigError, DSparkConfig
from dspark_sgl.model import DraftContextCache, DSparkDraft, load_draft
from dspark_sgl.model.draft import mla_rope
from dspark_sgl.speculative.engine import SpecEngine
from dspark_sgl.targets import HFTarget
from dspark_sgl.tools.quantize import QuantizeError, linear_modules, plan_quantization, quantize_draft
from tests.conftest import tiny_llama

V, H, L = 64, 32, 2
MLA = dict(attention_type="mla", num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
# Inferact/Kimi-K3-DSpark's config.json (as TorchSpec/ATOM exporters write it; vLLM's K3DSparkConfig reads it).
K3_CONFIG = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": 7168, "intermediate_size": 14336,
    "num_hidden_layers": 5, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": False,
    "mla_use_output_gate": False, "vocab_size": 163840, "rms_norm_eps": 1e-05, "max_position_embeddings": 1048576,
    "rope_theta": 50000.0, "num_target_layers": 5, "target_hidden_size": 7168, "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89], "mask_token_id": 163837, "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839, "markov_rank": 256, "markov_head_type": "vanilla",
    "enable_confidence_head": True, "confidence_head_with_markov": True, "tie_word_embeddings": False,
    "draft_vocab_size": 163840, "_torchspec_version": "0.1.0", "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                        "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
# vLLM K3DSparkForCausalLM checkpoint names per layer (its WeightsMapper / _duplicate_context_kv_weights read these).
VLLM_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
              "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VLLM_GLOBAL = ("context_proj.weight", "context_norm.weight", "final_norm.weight", "markov_head.markov_w1.weight",
               "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias")


def mla_config(**over) -> DSparkConfig:
    kw = dict(hidden_size=H, num_hidden_layers=L, head_dim=8, intermediate_size=64, vocab_size=V,
              target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=V - 1, markov_rank=8, block_size=4,
              **MLA, rope_scaling=dict(YARN))
    return DSparkConfig(**(kw | over))


def make_draft(**over) -> DSparkDraft:
    torch.manual_seed(0)
    d = DSparkDraft(mla_config(**over))
    with torch.no_grad():  # O(1) weights so every term matters numerically
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d.bind_target(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))


# ---- config ----------------------------------------------------------------------------------------------------
def test_inferact_k3_config_reads_and_writes_back_unchanged(tmp_path):
    c = DSparkConfig.from_dict(K3_CONFIG)
    assert (c.is_mla, c.num_aux, c.num_target_layers, c.kv_lora_rank, c.q_lora_rank) == (True, 5, 93, 512, 1536)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_theta == 50000.0 and not c.own_embed_tokens
    assert json.dumps(c.to_dict()) == json.dumps(K3_CONFIG)  # same keys, same order, same values
    c.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == K3_CONFIG
    assert DSparkConfig.from_pretrained(tmp_path) == c
    # A field we own changes where vLLM reads it; our own extras appear only when set.
    c.block_size, c.own_embed_tokens = 5, True
    out = c.to_dict()
    assert out["block_size"] == 5 and out["own_embed_tokens"] and DSparkConfig.from_dict(out) == c


def test_gqa_config_json_has_no_mla_keys():
    out = DSparkConfig.from_dict(mla_config().to_dict() | {"model_type": "qwen3"}).to_dict()  # still MLA: kv_lora
    assert out["model_type"] == "k3_dspark"
    gqa = mla_config(attention_type="gqa", num_key_value_heads=2).to_dict()
    assert not {"attention_type", "q_lora_rank", "kv_lora_rank", "own_embed_tokens", "source"} & set(gqa)


@pytest.mark.parametrize("bad,message", [
    (dict(num_target_layers=4), "must equal len\\(target_layer_ids\\)"),
    (dict(target_hidden_size=4096), "target_hidden_size=4096"),
    (dict(mla_use_output_gate=True), "not supported"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim must be even"),
    (dict(kv_lora_rank=0), "positive integers"),
])
def test_bad_mla_layout_gets_one_clear_error(bad, message):
    with pytest.raises(ConfigError, match=message):
        DSparkConfig.from_dict(K3_CONFIG | bad)


def test_k3_parameter_counts_match_the_cards():
    c = DSparkConfig.from_dict(K3_CONFIG)
    with torch.device("meta"):
        served = sum(p.numel() for p in DSparkDraft(c).parameters())
        c.own_embed_tokens = True
        full = sum(p.numel() for p in DSparkDraft(c).parameters())
    assert full == 3_562_312_961 and round(full / 1e9, 2) == 3.56  # cards 000/003: "3.56 B", "4B ... 7.12 GB"
    assert served == 2_387_907_841 and round(served / 1e9, 1) == 2.4  # card 003: "2.4 B params" without embed
    nvfp4 = plan_quantization(c, "nvfp4")  # card 000: "2.19 B of 3.56 B params quantized (61%)"
    shapes = linear_modules(c)
    quantized = sum(shapes[m][0] * shapes[m][1] for m in nvfp4)
    assert round(quantized / 1e9, 2) == 2.19 and round(quantized / full, 2) == 0.61
    mixed = plan_quantization(c, mixed={"o_proj": "mxfp4", "default": "fp8"})  # card 002
    by = {s: sorted(m for m, f in mixed.items() if f.name == s) for s in ("mxfp4", "fp8")}
    assert by["mxfp4"] == [f"layers.{i}.self_attn.o_proj" for i in range(5)] and len(by["fp8"]) == 25


# ---- model -----------------------------------------------------------------------------------------------------
def test_weight_names_are_vllms_k3_dspark_names():
    names = set(make_draft().state_dict())
    assert names == {f"layers.{i}.{n}.weight" for i in range(L) for n in VLLM_LAYER} | set(VLLM_GLOBAL)
    assert set(make_draft(own_embed_tokens=True).state_dict()) == names | {"embed_tokens.weight"}
    assert len(names) + 1 == 68 - 12 * (5 - L)  # K3: 68 tensors ("ATOM key contract: OK (68 tensors)")


@pytest.mark.parametrize("own_embed", [False, True])
def test_training_forward_equals_inference_forward(own_embed):
    d = make_draft(own_embed_tokens=own_embed)
    S = 12
    ids, aux = torch.randint(0, V - 1, (2, S)), torch.randn(2, S, 2 * H)
    anchors = torch.tensor([[0, 3, 7], [2, 5, 9]])
    h_train = d.forward_train(ids, aux, anchors)
    for n in range(3):
        cache = DraftContextCache(d, 2, "cpu", torch.float32)
        a = anchors[:, n]
        first = torch.minimum(a, torch.tensor(2))
        cache.append(aux, first)
        cache.append(aux, a - first, start=first)
        assert cache.k[0].shape[1:] == (1, cache.capacity, 32) and cache.v[0].shape[-1] == 4  # the latent
        h_inf = d.forward_step(ids.gather(1, a[:, None]).squeeze(1), cache)
        torch.testing.assert_close(h_inf, h_train[:, n], atol=1e-5, rtol=1e-5)


def test_latent_cache_is_the_whole_context_absorbed_attention_agrees():
    """vLLM's kernel never expands keys: q_nope is absorbed through W_UK, the output through W_UV. Same result."""
    d = make_draft()
    attn, T, S = d.layers[0].self_attn, 4, 6
    x, ctx = torch.randn(1, T, H), torch.randn(1, S, H)
    pos, ctx_pos = torch.arange(S, S + T)[None], torch.arange(S)[None]
    ck, cv = attn.kv(ctx, ctx_pos, d.inv_freq)
    mask = torch.ones(1, 1, T, S + T, dtype=torch.bool)
    mask[..., 1] = False
    want = attn(x, pos, ck, cv, mask, d.inv_freq)

    from dspark_sgl.model.draft import apply_rope_interleaved

    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, 4, 12).transpose(1, 2)
    q_nope, q_pe = q.split([8, 4], -1)
    q_pe = apply_rope_interleaved(q_pe, pos, d.inv_freq, attn.cos_scale)
    bk, bv = attn.kv(x, pos, d.inv_freq)
    lat, k_pe = torch.cat((ck, bk), 2)[:, 0], torch.cat((cv, bv), 2)  # [1, S+T, r], [1, 1, S+T, rope]
    w = attn.kv_b_proj.weight.view(4, 16, 32)
    w_uk, w_uv = w[:, :8], w[:, 8:]
    scores = torch.einsum("bhtn,hnr,bsr->bhts", q_nope, w_uk, lat) + q_pe @ k_pe.transpose(-1, -2)
    p = (scores * attn.softmax_scale).masked_fill(~mask, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bsr,hvr->bthv", p, lat, w_uv).reshape(1, T, -1)
    torch.testing.assert_close(attn.o_proj(o), want, atol=1e-5, rtol=1e-5)


def test_yarn_rope_follows_deepseek():
    inv, cos_scale, scale = mla_rope(mla_config())
    base = 1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    # correction range [0, 1] for d=4, θ=1e4, 16 original positions: the fast pair kept, the slow one / factor
    torch.testing.assert_close(inv.double(), torch.stack((base[0], base[1] / 4)), rtol=1e-6, atol=0)
    assert cos_scale == 1.0  # mscale == mscale_all_dim
    assert scale == pytest.approx(12**-0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    assert mla_rope(mla_config(rope_scaling=None))[2] == pytest.approx(12**-0.5)


def test_save_load_round_trip_and_vllm_folder(tmp_path):
    d = make_draft(own_embed_tokens=True)
    d.save_pretrained(tmp_path / "own")
    assert "embed_tokens.weight" in load_file(str(tmp_path / "own" / "model.safetensors"))
    back = load_draft(tmp_path / "own").bind_target(d.target.embed_tokens, d.target.lm_head)
    ids, aux, anchors = torch.randint(0, V - 1, (1, 9)), torch.randn(1, 9, 2 * H), torch.tensor([[2, 5]])
    torch.testing.assert_close(back.forward_train(ids, aux, anchors), d.forward_train(ids, aux, anchors))
    # The Inferact folder ships embed_tokens but its config has no own-embedding key: like vLLM, we skip it.
    d2 = make_draft()
    d2.save_pretrained(tmp_path / "vllm")
    state = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    save_file(state | {"embed_tokens.weight": torch.randn(V, H)}, str(tmp_path / "vllm" / "model.safetensors"))
    assert load_draft(tmp_path / "vllm").embed_tokens is None


# ---- serving ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("own_embed", [False, True])
def test_mla_draft_is_lossless_in_the_reference_engine(own_embed):
    target = HFTarget(tiny_llama(), [0, 2])
    prompts = [[5, 9, 3, 17, 2], [40, 41], [7, 7, 7, 30, 31, 32, 33, 8]]
    ref = SpecEngine(target).generate(prompts, 16)
    torch.manual_seed(1)
    c = mla_config(vocab_size=target.vocab_size, mask_token_id=target.vocab_size - 1, own_embed_tokens=own_embed)
    out = SpecEngine(target, DSparkDraft(c)).generate(prompts, 16)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


def test_sglang_worker_pool_holds_the_latent_and_equals_the_cache():
    from dspark_sgl.sglang.context import DraftContextPool

    d = make_draft()
    aux, n = torch.randn(1, 7, 2 * H), 7
    pool = DraftContextPool(d, 32, "cpu", torch.float32)
    assert pool.k.shape == (L, 32, 1, 32) and pool.v.shape == (L, 32, 1, 4)  # 36 values per token per layer
    slots = torch.tensor([3, 9, 4, 20, 11, 5, 30])
    pool.write(slots, aux[0], torch.arange(n))
    ctx = pool.gather(slots[None], torch.tensor([0]), torch.tensor([n]))
    cache = DraftContextCache(d, 1, "cpu", torch.float32)
    cache.append(aux, torch.tensor([n]))
    anchor = torch.tensor([5])
    torch.testing.assert_close(d.forward_step(anchor, ctx), d.forward_step(anchor, cache))


# ---- tools: the cards' tensor lists, GGUF, drift -----------------------------------------------------------------
@pytest.fixture
def mla_folder(tmp_path):
    d = make_draft(own_embed_tokens=True)
    d.save_pretrained(tmp_path / "draft")
    return tmp_path / "draft"


def layer_names(suffixes, layers=L):
    return sorted(f"layers.{i}.{s}.weight" for i in range(layers) for s in suffixes)


def test_card_000_nvfp4_recipe_tensor_list(mla_folder, tmp_path):
    m = quantize_draft(mla_folder, tmp_path / "nvfp4", recipe="kimi-k3-dspark-nvfp4").manifest
    want = layer_names(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.q_b_proj"))
    assert m["tensors_by_scheme"]["nvfp4"] == sorted(want + ["context_proj.weight"])
    bf16 = set(m["tensors_by_scheme"]["bf16"])
    assert {"embed_tokens.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight"} <= bf16
    assert set(layer_names(("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"))) <= bf16
    assert m["recipe"]["name"] == "kimi-k3-dspark-nvfp4"
    stored = load_file(str(tmp_path / "nvfp4" / "model.safetensors"))
    assert stored["layers.0.self_attn.q_b_proj.weight_packed"].dtype == torch.uint8  # two E2M1 per byte


def test_card_002_oproj_mxfp4_recipe_tensor_list(mla_folder, tmp_path):
    m = quantize_draft(mla_folder, tmp_path / "mx", recipe="kimi-k3-dspark-oproj-mxfp4").manifest
    assert m["tensors_by_scheme"]["mxfp4"] == layer_names(("self_attn.o_proj",))  # card: exactly the o_projs
    assert m["tensors_by_scheme"]["fp8"] == layer_names(
        ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"))
    assert m["counts"]["mxfp4"] == L and m["counts"]["fp8"] == 5 * L  # K3 (L=5): 5 MXFP4 + 25 FP8
    assert "context_proj.weight" in m["tensors_by_scheme"]["bf16"]
    o = m["quantized"]["layers.0.self_attn.o_proj.weight"]
    assert o["group_size"] == 32 and o["stored"]["layers.0.self_attn.o_proj.weight_scale"]["shape"] == [H, 32 // 32]
    assert o["stored"]["layers.0.self_attn.o_proj.weight_scale"]["dtype"] == "uint8"  # E8M0
    f = m["quantized"]["layers.0.self_attn.kv_b_proj.weight"]["stored"]["layers.0.self_attn.kv_b_proj.weight_scale"]
    assert f["dtype"] == "float32" and f["shape"][1] == 1  # per-output-channel FP32 scales
    on_disk = json.loads((tmp_path / "mx" / "quantization_manifest.json").read_text())
    assert on_disk["tensors_by_scheme"] == m["tensors_by_scheme"]


def test_fused_qkv_a_shards_must_share_a_scheme(mla_folder, tmp_path):
    c = mla_config()
    with pytest.raises(QuantizeError, match="fused shards must share a scheme"):
        plan_quantization(c, "fp8", include=["self_attn.q_a_proj"])
    plan = plan_quantization(c, "fp8", include=["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"])
    assert len(plan) == 2 * L
    with pytest.raises(QuantizeError, match="--recipe fixes the selection"):
        quantize_draft(mla_folder, tmp_path / "x", scheme="fp8", recipe="kimi-k3-dspark-nvfp4")
    with pytest.raises(QuantizeError, match="unknown --recipe"):
        quantize_draft(mla_folder, tmp_path / "x", recipe="kimi-k3-dspark-int3")


def test_gguf_dflash_mla_layout_reads_back_bit_for_bit(mla_folder, tmp_path):
    import gguf

    from dspark_sgl.tools.gguf_export import export_gguf

    bf16 = tmp_path / "bf16"
    load_draft(mla_folder).to(torch.bfloat16).save_pretrained(bf16)
    summary = export_gguf(bf16, tmp_path / "d.gguf")
    assert summary.stripped == ["embed_tokens.weight"]
    reader = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    got = {t.name: t for t in reader.tensors}
    per_layer = ("attn_norm", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b",
                 "attn_v_b", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    want = {f"blk.{i}.{n}.weight" for i in range(L) for n in per_layer} | {
        "fc.weight", "enc.output_norm.weight", "output_norm.weight", "markov_w1.weight", "markov_w2.weight",
        "conf_proj.weight", "conf_proj.bias"}
    assert set(got) == want and len(got) == 72 - 13 * (5 - L)  # card 003: 72 tensors for K3's 5 layers
    assert set(summary.written) == want
    fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("dflash.")}
    assert fields["dflash.attention.kv_lora_rank"] == 32 and fields["dflash.attention.q_lora_rank"] == 32
    assert fields["dflash.attention.key_length"] == 36 and fields["dflash.attention.value_length"] == 32
    assert fields["dflash.attention.key_length_mla"] == 12 and fields["dflash.attention.value_length_mla"] == 8
    assert fields["dflash.rope.dimension_count"] == 4 and fields["dflash.rope.scaling.factor"] == 4.0
    assert fields["dflash.block_size"] == 4 and fields["dflash.embedding_length"] == H
    assert list(fields["dflash.target_layers"]) == [1, 3] and fields["dflash.markov_rank"] == 8  # layer inputs

    def raw(name):  # bytes of a GGUF tensor as a torch tensor of its stored (numpy) shape
        t = got[name]
        shape = [int(d) for d in reversed(t.shape)]
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            return torch.from_numpy(np.array(t.data).view(np.uint16).reshape(shape).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.array(t.data).reshape(shape).copy())

    src = load_file(str(bf16 / "model.safetensors"))
    for i in range(L):
        k_b, v_b = raw(f"blk.{i}.attn_k_b.weight"), raw(f"blk.{i}.attn_v_b.weight")
        assert k_b.shape == (4, 32, 8) and v_b.shape == (4, 8, 32)
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(4 * 16, 32)
        assert torch.equal(kv_b.view(torch.uint16), src[f"layers.{i}.self_attn.kv_b_proj.weight"].view(torch.uint16))
        for ours, theirs in (("self_attn.q_a_proj", "attn_q_a"), ("self_attn.o_proj", "attn_output")):
            a, b = raw(f"blk.{i}.{theirs}.weight"), src[f"layers.{i}.{ours}.weight"]
            assert torch.equal(a.view(torch.uint16), b.view(torch.uint16))
        assert torch.equal(raw(f"blk.{i}.attn_kv_a_norm.weight"), src[f"layers.{i}.self_attn.kv_a_layernorm.weight"]
                           .float())
    assert torch.equal(raw("fc.weight").view(torch.uint16), src["context_proj.weight"].view(torch.uint16))


def test_drift_runs_the_three_regimes_on_an_mla_draft(mla_folder, tmp_path):
    from dspark_sgl.tools import drift as D

    q = quantize_draft(mla_folder, tmp_path / "mx", recipe="kimi-k3-dspark-oproj-mxfp4").out_dir
    ref, variants = D.load_variants(mla_folder, [str(q)], "fp32", floor=True)
    embed, head = D.synthetic_heads(V, H, 0)
    settings = D.DriftSettings(blocks=8, regimes=("boot", "heavy", "gauss"), seq_len=16, anchors_per_seq=2,
                               batch_seqs=4)
    report = D.run_drift(ref, variants, settings, embed, head)
    assert set(report.settings["regimes"]) == {"boot", "heavy", "gauss"}
    text = report.to_json()
    assert "mx" in text and re.search(r'"boot"', text)
