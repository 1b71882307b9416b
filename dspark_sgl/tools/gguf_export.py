"""Export a DSpark draft to GGUF for llama.cpp's `dflash` architecture (DFlash + Markov/confidence heads).

The layout is what llama.cpp's own reader wants (the llama.cpp vendored in `llama-cpp-python==0.3.36`:
`src/models/dflash.cpp`, `conversion/qwen.py` DSparkModel, `common/speculative.cpp` draft-dspark; docs/llamacpp.md):
the Qwen3 block tensors `blk.N.*`, `fc` (context projection), `enc.output_norm` (its RMSNorm, our `hidden_norm`),
`output_norm` (final norm), the DSpark heads `markov_w1` {R, V}, `markov_w2` {R, K}, `conf_proj` {H+R, 1} (+ bias).
Where the conventions differ, the export converts:
- `dflash.target_layers` are llama.cpp's extract ids, the INPUT of target layer j: our id i (the output of layer
  i) is written as i + 1, as llama.cpp's converter does;
- the mask id is `tokenizer.ggml.mask_token_id` (llama.cpp reads it from the vocabulary), and the tokenizer itself is
  copied from the target GGUF (`target_gguf`, the file served as `-m`): llama.cpp loads no model without one, and a
  draft whose vocabulary is byte-identical to its target's passes llama.cpp's draft/target compatibility check;
- a reduced vocabulary (`draft_vocab_size` K + `d2t`): llama.cpp wants the draft to carry its K-row head and `d2t` as
  absolute target ids (I64 [K]); we gather the target GGUF's own output rows (`output.weight`, or `token_embd.weight`
  when tied) at the hot ids, in the target's GGML type byte for byte (quantized blocks never straddle rows), so the
  draft scores its K tokens with exactly the numbers the target would;
- `dflash.sample_from_anchor` / `dflash.has_confidence_head`: the anchor-first block (γ inputs give γ drafts).
llama.cpp runs only the vanilla Markov head, with the confidence head reading [h ; markov_w1[prev]]; other heads
export only as `--arch dspark` (forks). Per-position STS temperatures are written but llama.cpp's
`--spec-draft-p-min` compares the raw sigmoid.

Card 003: the embedding and lm_head are the target's and never run in the draft graph (llama.cpp borrows them
from the target context), so they are stripped; a peer folder that ships them loses them here, by name, in the
summary. 2-D weights keep their source dtype byte for byte (BF16 stays BF16); 1-D norms and biases are widened
to F32 (exact), as llama.cpp's converters do, because ggml's norm kernels take F32. Non-vanilla Markov heads
(gated, rnn) export their extra projections as `markov_gate` / `markov_joint` under `--arch dspark`.

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
    # llama.cpp extracts the INPUT of target layer j (hidden_states[j]); our id i is the OUTPUT of layer i.
    w.add_array(f"{arch}.target_layers", [int(i) + 1 for i in c.target_layer_ids])
    w.add_uint32(f"{arch}.target_hidden_size", c.hidden_size)
    if c.num_target_layers is not None:
        w.add_uint32(f"{arch}.num_target_layers", c.num_target_layers)
    w.add_uint32(f"{arch}.block_size", c.block_size)
    w.add_uint32(f"{arch}.mask_token_id", int(c.mask_token_id))
    w.add_uint32("tokenizer.ggml.mask_token_id", int(c.mask_token_id))  # the key llama.cpp reads
    w.add_uint32(f"{arch}.markov_rank", c.markov_rank)
    w.add_string(f"{arch}.markov_head_type", c.markov_head_type)
    w.add_bool(f"{arch}.enable_confidence_head", c.enable_confidence_head)
    w.add_bool(f"{arch}.has_confidence_head", c.enable_confidence_head)  # llama.cpp's name for it
    w.add_bool(f"{arch}.confidence_head_with_markov", c.confidence_head_with_markov)
    w.add_bool(f"{arch}.sample_from_anchor", c.sample_from_anchor)
    if c.sts_temperatures is not None:
        w.add_array(f"{arch}.sts_temperatures", [float(t) for t in c.sts_temperatures])


@dataclass
class TargetGGUF:
    """What the draft takes from the target GGUF llama.cpp serves: its tokenizer and (reduced vocabulary) head rows."""

    path: Path
    reader: object

    @classmethod
    def open(cls, path: str | Path, config: DSparkConfig) -> TargetGGUF:
        import gguf

        path = Path(path)
        if not path.is_file():
            raise ExportError(f"target GGUF {path} does not exist")
        reader = gguf.GGUFReader(str(path))
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ExportError(f"{path} carries no tokenizer (tokenizer.ggml.tokens): not a llama.cpp target GGUF")
        target = cls(path, reader)
        arch = target.field("general.architecture")
        n_vocab, n_embd = len(reader.fields["tokenizer.ggml.tokens"].data), target.field(f"{arch}.embedding_length")
        if (n_vocab, n_embd) != (config.vocab_size, config.hidden_size):
            raise ExportError(
                f"target GGUF {path} has vocabulary {n_vocab} and hidden size {n_embd}; the draft was made for "
                f"{config.vocab_size} and {config.hidden_size}: not this draft's target"
            )
        return target

    def field(self, key: str):
        return self.reader.fields[key].contents()

    def copy_tokenizer(self, w) -> None:
        """Every tokenizer.* key, typed as in the target (the draft's vocabulary IS the target's)."""
        for key, f in self.reader.fields.items():
            if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
                w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)

    def head_rows(self, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """The target's output rows at these token ids: (payload, GGML type), byte for byte in the target's type."""
        tensors = {t.name: t for t in self.reader.tensors}
        head = tensors.get("output.weight") or tensors.get("token_embd.weight")  # tied: the embedding is the head
        if head is None:
            raise ExportError(f"{self.path} has neither output.weight nor token_embd.weight")
        rows = np.ascontiguousarray(head.data[ids])  # [V, H] elements or [V, bytes per row] for quantized types
        return rows, head.tensor_type


def _check_llama_cpp_graph(arch: str, c: DSparkConfig) -> None:
    """The upstream dflash graph runs the vanilla Markov head and a [h ; markov_w1[prev]] confidence head only."""
    if arch != "dflash":
        return
    if c.markov_head_type != "vanilla":
        raise ExportError(
            f"llama.cpp's dflash graph runs only the vanilla Markov head, not {c.markov_head_type!r}: "
            "export with --arch dspark (forks) or train a vanilla head"
        )
    if c.enable_confidence_head and not c.confidence_head_with_markov:
        raise ExportError("llama.cpp's confidence head reads [h ; markov_w1[prev]]: confidence_head_with_markov=false "
                          "has no llama.cpp equivalent")


def export_gguf(
    draft_dir: str | Path, out_path: str | Path, arch: str = "dflash", target_gguf: str | Path | None = None
) -> ExportSummary:
    """Write one GGUF file with every draft tensor (bit-exact) and the DSpark metadata llama.cpp reads.

    target_gguf: the target GGUF llama.cpp serves next to the draft (`-m`). Its tokenizer is copied (llama.cpp loads
    no model without one) and, for a reduced vocabulary, its output rows at the draft's K tokens become the draft's
    head. Without it the file holds the draft alone (card 003's tensor layout), which llama.cpp does not load."""
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
    if config.anchor_state:
        raise ExportError(f"{folder}: llama.cpp's DFlash/DSpark graph has no anchor_proj (anchor_state); serve this "
                          "draft with dspark-sgl, or train without draft.anchor_state")
    if config.reduced_vocab and target_gguf is None:
        raise ExportError(
            f"a reduced-vocabulary draft (draft_vocab_size={config.draft_vocab_size}) needs the target GGUF "
            "(--target): llama.cpp wants the draft's own K-row output head, the target's rows at the d2t ids"
        )
    if target_gguf is not None:
        _check_llama_cpp_graph(arch, config)
    target = None if target_gguf is None else TargetGGUF.open(target_gguf, config)
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
    if target is not None:
        target.copy_tokenizer(writer)

    def add(draft_name: str, target_name: str, data: np.ndarray, **kw) -> None:
        writer.add_tensor(target_name, data, **kw)
        prev = summary.tensors.get(draft_name)
        summary.tensors[draft_name] = target_name if prev is None else f"{prev},{target_name}"
        summary.written.append(target_name)
        summary.nbytes += data.nbytes

    for name in sorted(state):
        if name.startswith(STRIPPED) or name == "d2t":
            continue  # stripped ones are already listed in summary.stripped (read from the files); d2t below
        for gname, t in gguf_tensors(name, state[name], config):
            data, raw_dtype = _array(t)
            add(name, gname, data, raw_dtype=raw_dtype)
    if config.reduced_vocab:
        ids = (torch.arange(config.draft_vocab_size) + state["d2t"].long()).numpy()  # absolute target ids
        add("d2t", "d2t", ids.astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        rows, qtype = target.head_rows(ids)
        typed = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)  # numpy-typed rows
        add("(target head rows)", "output.weight", rows, raw_dtype=None if typed else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return summary
