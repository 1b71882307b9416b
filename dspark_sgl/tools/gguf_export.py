"""Export a DSpark draft to GGUF for llama.cpp's `dflash` architecture (DFlash + Markov/confidence heads).

Names follow llama.cpp master's gguf-py constants for MODEL_ARCH.DFLASH (the PyPI `gguf` release predates
them, so they are spelled out here): the Qwen3 block tensors `blk.N.*`, `fc` (context projection),
`enc.output_norm` (its RMSNorm, our `hidden_norm`), `output_norm` (final norm), and the optional DSpark heads
`markov_w1`, `markov_w2`, `conf_proj` (weight + bias). llama.cpp reads the Markov rank from markov_w1's shape;
we also write `{arch}.markov_rank` and the other DSpark keys, which the `dspark` arch variant of forks
requires.

Card 003: the embedding and lm_head are the target's and never run in the draft graph (llama.cpp borrows them
from the target context), so they are stripped; a peer folder that ships them loses them here, by name, in the
summary. 2-D weights keep their source dtype byte for byte (BF16 stays BF16); 1-D norms and biases are widened
to F32 (exact), as llama.cpp's converters do, because ggml's norm kernels take F32. Non-vanilla Markov heads
(gated, rnn) export their extra projections as `markov_gate` / `markov_joint`; upstream llama.cpp only runs
the vanilla head.

MLA drafts (card 003, the dflash+MLA layout): llama.cpp's DeepSeek-2 names (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`,
`attn_kv_a_mqa`, `attn_kv_a_norm`, `attn_output`) and kv_b_proj split per head into `attn_k_b` [n_head, kv_lora,
nope] (transposed, for weight absorption) and `attn_v_b` [n_head, v, kv_lora], as convert_hf_to_gguf.py does;
`{arch}.attention.{q,kv}_lora_rank` plus the DeepSeek-2 key/value lengths (latent 576 / 512, per-head MLA 192 / 128),
the rope dimension count and YaRN keys. An own `embed_tokens` is stripped like the target's (K3: 72 tensors).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.checkpoint import SKIPPED_PREFIXES, check_state_dict, read_state_dict, safetensors_index

ARCHES = ("dflash", "dspark")
GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "markov_head.gate_proj.weight": "markov_gate.weight",
    "markov_head.gate_proj.bias": "markov_gate.bias",
    "markov_head.joint_proj.weight": "markov_joint.weight",
    "markov_head.joint_proj.bias": "markov_joint.bias",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MLA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MLA_GLOBAL_NAMES = {"context_proj.weight": "fc.weight", "context_norm.weight": "enc.output_norm.weight",
                    "final_norm.weight": "output_norm.weight"}
STRIPPED = ("embed_tokens.",)  # an own-embedding draft's table: llama.cpp embeds with the target's
FILE_TYPES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 32,
}  # llama_ftype ALL_F32 / MOSTLY_F16 / _BF16


class ExportError(ValueError):
    """A draft folder that cannot be exported (quantized, unknown tensors, unsupported dtype)."""


@dataclass
class ExportSummary:
    path: Path
    arch: str
    tensors: dict[str, str] = field(default_factory=dict)  # draft name -> gguf name(s), comma-joined when split
    written: list[str] = field(default_factory=list)  # every GGUF tensor name, in file order
    stripped: list[str] = field(default_factory=list)
    nbytes: int = 0


def gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in LAYER_NAMES:
        return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise ExportError(f"no GGUF name for draft tensor {name!r}")


def gguf_tensors(name: str, t: Tensor, c: DSparkConfig) -> list[tuple[str, Tensor]]:
    """GGUF (name, tensor) pairs for one draft tensor: one, or MLA's kv_b_proj split into k_b and v_b."""
    if not c.is_mla:
        return [(gguf_name(name), t)]
    if name in MLA_GLOBAL_NAMES:
        return [(MLA_GLOBAL_NAMES[name], t)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) == "self_attn.kv_b_proj.weight":
        kv_b = t.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        return [(f"blk.{m.group(1)}.attn_k_b.weight", k_b.transpose(1, 2)), (f"blk.{m.group(1)}.attn_v_b.weight", v_b)]
    if m and m.group(2) in MLA_LAYER_NAMES:
        return [(f"blk.{m.group(1)}.{MLA_LAYER_NAMES[m.group(2)]}", t)]
    if name in GLOBAL_NAMES and not name.startswith(("fc.", "hidden_norm.", "norm.")):
        return [(GLOBAL_NAMES[name], t)]
    raise ExportError(f"no GGUF name for MLA draft tensor {name!r}")


def _write_mla_attention(w, arch: str, c: DSparkConfig) -> None:
    """DeepSeek-2's MLA keys: latent key/value lengths for the absorbed cache, per-head lengths for the MLA path."""
    w.add_head_count_kv(1)
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    scaling = c.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) in ("yarn", "deepseek_yarn"):
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(scaling.get("mscale_all_dim", 0.0)))
        w.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast", 32)))
        w.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow", 1)))


def _stripped(folder: Path) -> list[str]:
    return sorted(n for n in safetensors_index(folder) if n.startswith(SKIPPED_PREFIXES))


def _array(t: Tensor) -> tuple[np.ndarray, object]:
    """Tensor -> (numpy payload, raw GGML dtype or None). BF16 goes as its raw uint16 bits."""
    import gguf

    t = t.detach().contiguous().cpu()
    if t.dim() == 1:
        return t.float().numpy(), None
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy(), gguf.GGMLQuantizationType.BF16
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), None
    raise ExportError(f"cannot export a {t.dtype} tensor to GGUF (float32/float16/bfloat16 only)")


def _write_metadata(w, arch: str, c: DSparkConfig, file_type: int, name: str) -> None:
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    if c.is_mla:
        _write_mla_attention(w, arch, c)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
    scaling = c.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    w.add_causal_attention(False)
    w.add_array(f"{arch}.target_layers", [int(i) for i in c.target_layer_ids])
    w.add_uint32(f"{arch}.target_hidden_size", c.hidden_size)
    if c.num_target_layers is not None:
        w.add_uint32(f"{arch}.num_target_layers", c.num_target_layers)
    w.add_uint32(f"{arch}.block_size", c.block_size)
    w.add_uint32(f"{arch}.mask_token_id", int(c.mask_token_id))
    w.add_uint32(f"{arch}.markov_rank", c.markov_rank)
    w.add_string(f"{arch}.markov_head_type", c.markov_head_type)
    w.add_bool(f"{arch}.enable_confidence_head", c.enable_confidence_head)
    w.add_bool(f"{arch}.confidence_head_with_markov", c.confidence_head_with_markov)
    w.add_bool(f"{arch}.sample_from_anchor", c.sample_from_anchor)
    if c.sts_temperatures is not None:
        w.add_array(f"{arch}.sts_temperatures", [float(t) for t in c.sts_temperatures])


def export_gguf(draft_dir: str | Path, out_path: str | Path, arch: str = "dflash") -> ExportSummary:
    """Write one GGUF file with every draft tensor (bit-exact) and the DSpark metadata llama.cpp reads."""
    import gguf

    from dspark_sgl.model.draft import DSparkDraft

    folder = Path(draft_dir)
    if arch not in ARCHES:
        raise ExportError(f"arch must be one of {ARCHES}, got {arch!r}")
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else None
    if raw is None:
        raise ExportError(f"{folder} is not a draft folder (no config.json)")
    if "quantization_config" in raw:
        raise ExportError(
            f"{folder} is a compressed-tensors checkpoint; export the unquantized draft and quantize "
            "with llama-quantize (GGUF has its own formats)"
        )
    config = DSparkConfig.from_dict(raw)
    try:
        config.require_full_vocab("GGUF export (llama.cpp's dflash/dspark graph)")
    except ValueError as e:
        raise ExportError(str(e)) from e
    sts = folder / "sts.json"
    if sts.exists() and config.sts_temperatures is None:
        config.sts_temperatures = json.loads(sts.read_text())["temperatures"]
    state = read_state_dict(folder)
    with torch.device("meta"):
        check_state_dict(DSparkDraft(config), state)
    counts = Counter(t.dtype for t in state.values() if t.dim() == 2)  # the fp32 confidence head is a minority
    file_type = FILE_TYPES.get(counts.most_common(1)[0][0], 0)

    summary = ExportSummary(Path(out_path), arch, stripped=_stripped(folder))
    summary.path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(summary.path), arch)
    _write_metadata(writer, arch, config, file_type, folder.resolve().name)
    for name in sorted(state):
        if name.startswith(STRIPPED):
            continue  # already listed in summary.stripped (read from the files)
        for target, t in gguf_tensors(name, state[name], config):
            data, raw_dtype = _array(t)
            writer.add_tensor(target, data, raw_dtype=raw_dtype)
            summary.tensors[name] = target if name not in summary.tensors else f"{summary.tensors[name]},{target}"
            summary.written.append(target)
            summary.nbytes += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return summary
