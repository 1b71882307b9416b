"""Quantize -> save -> load -> forward for every scheme; the card selections; the compressed-tensors config"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.checkpoint import read_state_dict
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.model.formats import FormatError, dequantize_state_dict, get_format
from dspark_sgl.tools.quantize import (
    MANIFEST_FILE,
    QuantizeError,
    parse_mixed,
    plan_quantization,
    quantize_draft,
)
from tests.conftest import require, tiny_draft_config

require("compressed_tensors")


def tiny_config(layers: int = 5, **kw) -> DSparkConfig:
    shape = dict(num_hidden_layers=layers, intermediate_size=96, vocab_size=128, target_layer_ids=[1, 2])
    return tiny_draft_config(**(shape | kw))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("draft") / "src"
    DSparkDraft(tiny_config()).save_pretrained(folder)
    return folder


@torch.no_grad()
def run_forward(model: DSparkDraft) -> torch.Tensor:
    c = model.config
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the same stand-in target heads for every model
    model.bind_target(torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size))
    ids = torch.randint(0, c.vocab_size - 1, (2, 12), generator=g)
    aux = torch.randn(2, 12, c.num_aux * c.hidden_size, generator=g)
    return model.forward_train(ids, aux, torch.tensor([[2, 7], [1, 5]]))


CARD_002_FP8 = sorted(
    f"layers.{i}.{p}.weight"
    for i in range(5)
    for p in (
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
    )
)


def test_mixed_oproj_mxfp4_manifest_lists_exactly_the_card_002_tensors(source, tmp_path):
    result = quantize_draft(source, tmp_path / "mixed", mixed="o_proj=mxfp4,default=fp8")
    by = result.manifest["tensors_by_scheme"]
    assert by["mxfp4"] == [f"layers.{i}.self_attn.o_proj.weight" for i in range(5)]  # exactly these five
    assert by["fp8"] == CARD_002_FP8  # GQA counterparts of gate/up/down + q_b/kv_b: 30 FP8 weights
    assert "fc.weight" in by["bf16"] and "markov_head.markov_w2.weight" in by["bf16"]
    assert "confidence_head.proj.weight" in by["bf16"]
    on_disk = json.loads((tmp_path / "mixed" / MANIFEST_FILE).read_text())
    assert on_disk["tensors_by_scheme"] == by
    qc = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert qc["quantization_status"] == "compressed"
    formats = {g["format"]: g for g in qc["config_groups"].values()}
    assert formats["mxfp4-pack-quantized"]["targets"] == [r"re:^(.*\.)?layers\.\d+\.self_attn\.o_proj$"]
    assert formats["mxfp4-pack-quantized"]["weights"]["group_size"] == 32
    assert formats["float-quantized"]["weights"]["strategy"] == "channel"
    assert sorted(qc["ignore"]) == ["confidence_head.proj", "fc", "markov_head.markov_w2"]


def test_config_is_accepted_by_compressed_tensors(source, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    quantize_draft(source, tmp_path / "q", scheme="nvfp4")
    qc = QuantizationConfig.model_validate(
        json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    )
    (group,) = qc.config_groups.values()
    assert group.format == "nvfp4-pack-quantized" and group.weights.strategy == "tensor_group"
    assert group.weights.group_size == 16 and qc.format == "nvfp4-pack-quantized"


@pytest.mark.parametrize("scheme,packed", [("fp8", False), ("nvfp4", True), ("mxfp4", True)])
def test_quantize_save_load_forward(source, tmp_path, scheme, packed):
    out = tmp_path / scheme
    result = quantize_draft(source, out, scheme=scheme)
    by = result.manifest["tensors_by_scheme"]
    assert "fc.weight" in by[scheme] and "layers.4.self_attn.o_proj.weight" in by[scheme]  # card 000 selection
    assert len(by[scheme]) == 5 * 7 + 1
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        keys = set(st.keys())
        name = "layers.0.mlp.up_proj"
        assert (f"{name}.weight_packed" in keys) == packed and (f"{name}.weight" in keys) == (not packed)
        assert st.get_tensor("layers.0.input_layernorm.weight").dtype == torch.bfloat16
        assert ("layers.0.mlp.up_proj.weight_global_scale" in keys) == (scheme == "nvfp4")
    ref = DSparkDraft.from_pretrained(source)
    loaded = DSparkDraft.from_pretrained(out)
    w_ref, w_q = ref.layers[0].mlp.up_proj.weight, loaded.layers[0].mlp.up_proj.weight
    assert not torch.equal(w_ref, w_q)
    rel = float((w_ref - w_q).detach().norm() / w_ref.detach().norm())
    assert rel < {"fp8": 0.04, "nvfp4": 0.15, "mxfp4": 0.15}[scheme]
    assert torch.equal(loaded.norm.weight, ref.norm.weight.to(torch.bfloat16).float())
    h = run_forward(loaded)
    assert h.shape == (2, 2, 4, 64) and torch.isfinite(h).all()
    assert float((h - run_forward(ref)).norm() / run_forward(ref).norm()) < 0.5


def test_dequantize_matches_quantizer_exactly(source, tmp_path):
    quantize_draft(source, tmp_path / "q", mixed="o_proj=nvfp4,default=fp8")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "q" / "model.safetensors"))
    state = dequantize_state_dict(raw, qc)
    assert not any(k.endswith(("_scale", "_packed")) for k in state)
    from dspark_sgl.model.formats import dequantize_weight, quantize_weight

    src = read_state_dict(source)
    want = dequantize_weight(
        quantize_weight(src["layers.3.self_attn.o_proj.weight"], get_format("nvfp4")), get_format("nvfp4")
    )
    assert torch.equal(state["layers.3.self_attn.o_proj.weight"], want)


def test_include_exclude_and_mixed_patterns(source):
    c = tiny_config()
    plan = plan_quantization(c, "fp8", include=["layers.*.mlp.*"], exclude=["layers.0.*"])
    assert sorted(plan) == sorted(
        f"layers.{i}.mlp.{p}" for i in range(1, 5) for p in ("gate_proj", "up_proj", "down_proj")
    )
    plan = plan_quantization(c, mixed=parse_mixed("down_proj=nvfp4,default=mxfp4"))
    assert plan["layers.2.mlp.down_proj"].name == "nvfp4" and plan["layers.2.mlp.up_proj"].name == "mxfp4"
    assert "fc" not in plan
    plan = plan_quantization(c, mixed=parse_mixed("o_proj=mxfp4"))  # no default: only the named modules
    assert sorted(plan) == [f"layers.{i}.self_attn.o_proj" for i in range(5)]
    plan = plan_quantization(c, "fp8", include=["markov_head.markov_w2"])
    assert list(plan) == ["markov_head.markov_w2"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scheme="fp4"), "unknown quantization scheme"),
        (dict(), "give --scheme"),
        (dict(scheme="fp8", include=["no_such_proj"]), "matches no quantizable"),
        (dict(scheme="fp8", include=["confidence_head.proj"]), "confidence head is never quantized"),
        (dict(scheme="fp8", exclude=["typo_proj"]), "matches no quantizable"),
    ],
)
def test_bad_requests_get_one_clear_error(source, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_quantization(tiny_config(), **kwargs)


def test_bad_mixed_spec_and_folders(source, tmp_path):
    with pytest.raises(QuantizeError, match="PATTERN=SCHEME"):
        parse_mixed("o_proj")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        parse_mixed("o_proj=int3")
    quantize_draft(source, tmp_path / "q", scheme="fp8")
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_draft(tmp_path / "q", tmp_path / "qq", scheme="fp8")
    with pytest.raises(QuantizeError, match="no config.json"):
        quantize_draft(tmp_path / "nowhere", tmp_path / "x", scheme="fp8")


def test_group_size_mismatch_names_the_tensor(tmp_path):
    folder = tmp_path / "odd"
    DSparkDraft(tiny_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1)).save_pretrained(folder)
    with pytest.raises(QuantizeError, match=r"layers\.0\..*not a multiple of the mxfp4 group size 32"):
        quantize_draft(folder, tmp_path / "q", scheme="mxfp4")
    quantize_draft(folder, tmp_path / "q8", scheme="nvfp4")  # 48 = 3 groups of 16 is fine


def test_unsupported_foreign_format_is_rejected():
    raw = {"m.weight_packed": torch.zeros(2, 4, dtype=torch.uint8), "m.weight_scale": torch.ones(2, 1)}
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}},
    }
    with pytest.raises(FormatError, match="'pack-quantized' is not supported"):
        dequantize_state_dict(raw, cfg)
