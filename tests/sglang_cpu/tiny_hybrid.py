"""A tiny random-init Kimi-Linear (KDA + MLA hybrid) checkpoint that real SGLang serves on CPU (tests only).

SGLang's `KimiLinearForCausalLM` (`models/kimi_linear.py`) is the K3 family's constructible member: `kimi_k3.py`
builds `torch.cuda.Stream()`s and K3-only fused paths at construction, so on CPU the tests serve Kimi-Linear, which
shares K3's state machinery (KDA layers from `linear_attn_config["kda_layers"]`, 1-indexed; MLA
`DeepseekV2AttentionMLA` full-attention layers; `HybridLinearAttnBackend` + `KDAAttnBackend`; `MambaPool`).
Weights use the checkpoint names `KimiLinearForCausalLM.load_weights` maps; the tokenizer is SmolLM2's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_kimi_linear_config(vocab_size: int, hidden: int = 128, layers: int = 4, kda_layers=(1, 2, 4)) -> dict:
    """KDA at the 1-indexed `kda_layers`, MLA elsewhere; dense MLPs (no MoE), fp32."""
    full = [i for i in range(1, layers + 1) if i not in kda_layers]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": list(kda_layers), "full_attn_layers": full, "head_dim": 32,
                               "num_heads": 4, "short_conv_kernel_size": 4},
    }


def tiny_kimi_linear_weights(cfg: dict, seed: int = 0) -> dict:
    """Random weights, scaled so that a 4-layer model's greedy output is not a constant string."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, V, FF = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    la = cfg["linear_attn_config"]
    nh, hd, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = nh * hd
    mh, nope, rope, vd, r = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                             cfg["v_head_dim"], cfg["kv_lora_rank"])

    def w(*shape, fan_in=None):
        return torch.randn(*shape, generator=g) / (fan_in or shape[-1]) ** 0.5

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "model.norm.weight": torch.ones(H),
          "lm_head.weight": w(V, H) * 2.0}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
               p + "mlp.gate_proj.weight": w(FF, H), p + "mlp.up_proj.weight": w(FF, H),
               p + "mlp.down_proj.weight": w(H, FF)}
        a = p + "self_attn."
        if i + 1 in la["kda_layers"]:
            sd |= {a + "q_proj.weight": w(P, H), a + "k_proj.weight": w(P, H), a + "v_proj.weight": w(P, H),
                   a + "b_proj.weight": w(nh, H), a + "f_a_proj.weight": w(hd, H), a + "g_a_proj.weight": w(hd, H),
                   a + "f_b_proj.weight": w(P, hd), a + "g_b_proj.weight": w(P, hd),
                   a + "q_conv1d.weight": w(P, 1, K), a + "k_conv1d.weight": w(P, 1, K),
                   a + "v_conv1d.weight": w(P, 1, K),
                   a + "dt_bias": torch.randn(P, generator=g) * 0.5,
                   a + "A_log": torch.log(torch.rand(1, 1, nh, 1, generator=g) * 4 + 1),
                   a + "o_norm.weight": torch.ones(hd), a + "o_proj.weight": w(H, P)}
        else:
            sd |= {a + "q_proj.weight": w(mh * (nope + rope), H), a + "kv_a_proj_with_mqa.weight": w(r + rope, H),
                   a + "kv_a_layernorm.weight": torch.ones(r), a + "kv_b_proj.weight": w(mh * (nope + vd), r),
                   a + "o_proj.weight": w(H, mh * vd)}
    return {k: v.float().contiguous() for k, v in sd.items()}


def build_tiny_kimi_linear(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **config) -> Path:
    """Write config.json, model.safetensors and SmolLM2's tokenizer files to out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    cfg = tiny_kimi_linear_config(vocab, **config)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tiny_kimi_linear_weights(cfg, seed), str(out_dir / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir


# Server flags for a KDA hybrid on CPU: the mamba radix cache's extra buffer needs platform snapshot support (CUDA),
# so the prefix cache keeps no intermediate states (no_buffer, which needs the non-overlap scheduler); enough state
# slots for 9 concurrent requests plus the speculative scratch.
HYBRID_SERVER_ARGS = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
                      "--max-mamba-cache-size", "64")
# Lossless checks run in fp32, conv windows included (SGLang keeps them in bf16 by default; a bf16 window rounds past
# inputs in one-token decode but not inside a multi-token verify, which flipped 2 of 9 greedy outputs here).
HYBRID_SERVER_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
