"""export-gguf: llama.cpp dflash names and metadata; every tensor read back bit-for-bit with `gguf`; the target's
tokenizer and (reduced vocabulary) its K hot output rows + absolute d2t, as llama.cpp loads them (that llama.cpp
really loads and drafts with these files: tests/test_llamacpp.py)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.tools.gguf_export import ExportError, export_gguf, gguf_name
from tests.conftest import require, tiny_draft_config


def tiny(**kw) -> DSparkConfig:
    shape = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48, vocab_size=64)
    return tiny_draft_config(**(shape | dict(block_size=7, num_target_layers=4, markov_rank=8) | kw))


@pytest.fixture
def bf16_draft(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "draft"
    DSparkDraft(tiny()).to(torch.bfloat16).save_pretrained(folder)
    # A peer checkpoint that ships the target's embedding and lm_head (card 003): they must be stripped.
    state = load_file(str(folder / "model.safetensors"))
    state["embed_tokens.weight"] = torch.randn(64, 32).to(torch.bfloat16)
    state["lm_head.weight"] = torch.randn(64, 32).to(torch.bfloat16)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def field(reader, key):
    return reader.fields[key].contents()


def test_every_tensor_round_trips_bit_for_bit(bf16_draft, tmp_path):
    summary = export_gguf(bf16_draft, tmp_path / "d.gguf")
    assert summary.stripped == ["embed_tokens.weight", "lm_head.weight"]
    source = {
        k: v
        for k, v in load_file(str(bf16_draft / "model.safetensors")).items()
        if not k.startswith(("embed_tokens", "lm_head"))
    }
    reader = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(summary.tensors.values()) and len(tensors) == len(source)
    assert not any("token_embd" in n or n == "output.weight" for n in tensors)
    for name, t in source.items():
        r = tensors[gguf_name(name)]
        assert [int(d) for d in reversed(r.shape)] == list(t.shape), name  # GGUF stores ne (reversed) dims
        if t.dim() == 2 and t.dtype == torch.bfloat16:
            assert r.tensor_type == gguf.GGMLQuantizationType.BF16
            assert np.array_equal(r.data.reshape(-1), t.contiguous().view(torch.uint8).numpy().reshape(-1)), name
        else:  # 1-D norms/biases are widened to F32 (exact); the fp32 confidence head stays F32
            assert r.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.array_equal(r.data.reshape(t.shape), t.float().numpy()), name


def test_names_and_metadata_llama_cpp_reads(bf16_draft, tmp_path):
    export_gguf(bf16_draft, tmp_path / "d.gguf")
    r = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    names = {t.name for t in r.tensors}
    assert {
        "fc.weight",
        "enc.output_norm.weight",
        "output_norm.weight",
        "markov_w1.weight",
        "markov_w2.weight",
        "conf_proj.weight",
        "conf_proj.bias",
        "blk.1.attn_q.weight",
        "blk.1.attn_output.weight",
        "blk.1.attn_q_norm.weight",
        "blk.0.ffn_norm.weight",
        "blk.0.ffn_down.weight",
    } <= names
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert shapes["markov_w1.weight"] == [8, 64] and shapes["markov_w2.weight"] == [8, 64]  # {R, n_vocab}
    assert shapes["conf_proj.weight"] == [32 + 8, 1] and shapes["fc.weight"] == [
        64,
        32,
    ]  # {n_embd+R,1}, {K·n,n}
    assert field(r, "general.architecture") == "dflash"
    assert field(r, "dflash.target_layers") == [1, 3]  # llama.cpp extracts layer INPUTS: our ids [0, 2] + 1
    assert field(r, "dflash.block_size") == 7 and field(r, "tokenizer.ggml.mask_token_id") == 63
    assert field(r, "dflash.sample_from_anchor") is True and field(r, "dflash.has_confidence_head") is True
    assert field(r, "dflash.markov_rank") == 8 and field(r, "dflash.markov_head_type") == "vanilla"
    assert field(r, "dflash.enable_confidence_head") is True
    assert field(r, "dflash.attention.causal") is False
    assert field(r, "dflash.block_count") == 2 and field(r, "dflash.embedding_length") == 32
    assert field(r, "dflash.attention.head_count_kv") == 1 and field(r, "dflash.target_hidden_size") == 32
    assert field(r, "general.file_type") == 32  # MOSTLY_BF16


def test_dspark_arch_and_sts_temperatures(tmp_path):
    folder = tmp_path / "d"
    DSparkDraft(tiny(markov_head_type="gated")).save_pretrained(folder)
    (folder / "sts.json").write_text(json.dumps({"temperatures": [1.0 + i / 10 for i in range(7)]}))
    export_gguf(folder, tmp_path / "d.gguf", arch="dspark")
    r = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    assert field(r, "general.architecture") == "dspark" and field(r, "dspark.markov_head_type") == "gated"
    assert field(r, "dspark.sts_temperatures") == pytest.approx([1.0 + i / 10 for i in range(7)])
    assert {"markov_gate.weight", "markov_gate.bias"} <= {t.name for t in r.tensors}
    assert field(r, "general.file_type") == 0  # all F32


def test_rejects_quantized_and_unknown(bf16_draft, tmp_path):
    require("compressed_tensors")
    from dspark_sgl.tools.quantize import quantize_draft

    quantize_draft(bf16_draft, tmp_path / "q", scheme="fp8")
    with pytest.raises(ExportError, match="compressed-tensors checkpoint"):
        export_gguf(tmp_path / "q", tmp_path / "q.gguf")
    with pytest.raises(ExportError, match="arch must be one of"):
        export_gguf(bf16_draft, tmp_path / "x.gguf", arch="llama")
    with pytest.raises(ExportError, match="no GGUF name"):
        gguf_name("layers.0.self_attn.rotary.weight")


def fake_target(path, vocab=64, hidden=32, qtype=None, tied=True):
    """A llama-arch target GGUF with a tokenizer and an lm_head (token_embd when tied), F32 or quantized."""
    rng = np.random.default_rng(0)
    head = rng.standard_normal((vocab, hidden)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(hidden)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    name = "token_embd.weight" if tied else "output.weight"
    if qtype is None:
        w.add_tensor(name, head)
    else:
        w.add_tensor(name, gguf.quants.quantize(head, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_reduced_vocabulary_carries_the_targets_hot_rows_and_absolute_d2t(tmp_path, qtype):
    """llama.cpp scatters the K-row head's logits through d2t (absolute ids): the head must be the target's own rows
    at exactly those ids, in the target's type byte for byte (tests the K-row head llama.cpp asserts on)."""
    torch.manual_seed(0)
    draft = DSparkDraft(tiny(draft_vocab_size=8))
    hot = torch.tensor([0, 3, 5, 9, 17, 40, 41, 63])
    draft.set_vocab(hot)
    draft.save_pretrained(tmp_path / "d")
    target = fake_target(tmp_path / "t.gguf", qtype=qtype)
    export_gguf(tmp_path / "d", tmp_path / "d.gguf", target_gguf=target)
    r, t = gguf.GGUFReader(str(tmp_path / "d.gguf")), gguf.GGUFReader(str(target))
    got = {x.name: x for x in r.tensors}
    head = {x.name: x for x in t.tensors}["token_embd.weight"]
    assert got["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert got["d2t"].data.tolist() == hot.tolist()
    out = got["output.weight"]
    assert out.tensor_type == head.tensor_type and [int(d) for d in out.shape] == [32, 8]
    assert np.array_equal(np.asarray(out.data), np.asarray(head.data)[hot.numpy()])
    assert [int(d) for d in got["markov_w2.weight"].shape] == [8, 8]  # {R, K}
    assert [int(d) for d in got["markov_w1.weight"].shape] == [8, 64]  # {R, V}
    assert field(r, "tokenizer.ggml.tokens") == field(t, "tokenizer.ggml.tokens")
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.mask_token_id") == 63


def test_full_vocabulary_with_target_has_tokenizer_and_no_head(tmp_path):
    DSparkDraft(tiny()).save_pretrained(tmp_path / "d")
    export_gguf(tmp_path / "d", tmp_path / "d.gguf", target_gguf=fake_target(tmp_path / "t.gguf", tied=False))
    r = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    names = {x.name for x in r.tensors}
    assert "output.weight" not in names and "d2t" not in names and "token_embd.weight" not in names
    assert field(r, "tokenizer.ggml.bos_token_id") == 1 and len(field(r, "tokenizer.ggml.tokens")) == 64


def test_refusals_for_llama_cpp(tmp_path):
    DSparkDraft(tiny(draft_vocab_size=8)).save_pretrained(tmp_path / "k")
    with pytest.raises(ExportError, match="reduced-vocabulary draft .* needs the target GGUF"):
        export_gguf(tmp_path / "k", tmp_path / "k.gguf")
    DSparkDraft(tiny()).save_pretrained(tmp_path / "d")
    with pytest.raises(ExportError, match="vocabulary 48 .* not this draft's target"):
        export_gguf(tmp_path / "d", tmp_path / "d.gguf", target_gguf=fake_target(tmp_path / "t48.gguf", vocab=48))
    with pytest.raises(ExportError, match="does not exist"):
        export_gguf(tmp_path / "d", tmp_path / "d.gguf", target_gguf=tmp_path / "nope.gguf")
    DSparkDraft(tiny(markov_head_type="gated")).save_pretrained(tmp_path / "g")
    target = fake_target(tmp_path / "t.gguf")
    with pytest.raises(ExportError, match="only the vanilla Markov head"):
        export_gguf(tmp_path / "g", tmp_path / "g.gguf", target_gguf=target)
    export_gguf(tmp_path / "g", tmp_path / "g.gguf", arch="dspark", target_gguf=target)  # forks run it
    DSparkDraft(tiny(anchor_state=True)).save_pretrained(tmp_path / "a")  # anchor_proj: no llama.cpp tensor
    with pytest.raises(ExportError, match="no anchor_proj"):
        export_gguf(tmp_path / "a", tmp_path / "a.gguf", arch="dspark", target_gguf=target)
