"""`serve_kimi_k3.sh --dry-run`: per-rank memory and per-step collectives of a DSPARK launch, from configs alone.

It parses the argument list the script would hand to `sglang serve`, reads the target's config.json and the draft's
config, and prints what every rank holds. Nothing is allocated, no weights are read, SGLang is not imported:

- target weights: the shape SGLang 0.5.23's model code gives each weight (models/kimi_k3.py: KDA + MLA layers, latent
  MoE; MLA as DeepseekV2AttentionMLA), sharded the way SGLang shards it at this TP size (`ASSUMPTIONS`);
- draft weights: the draft is built on the meta device (as training/dryrun.py builds it) and each parameter is kept
  whole or split by name (`draft_shard_dim`), for two layouts: replicated (our worker today) and TP-sharded;
- caches: the MLA latent KV (split over the DCP ranks), the KDA recurrent state (persistent slots plus the verify
  scratch SGLang allocates for speculative decoding) and our draft's context pool (`context.py`).

`plan()` returns the numbers (bytes per rank); `main()` prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass, replace
from fractions import Fraction
from importlib.metadata import entry_points
from pathlib import Path

import torch

from dspark_sgl.config import ConfigError, DSparkConfig, read_target_config

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
STAND_IN_TARGET = ROOT / "configs" / "kimi-k3-target"  # K3's config.json is not in this project: see its _provenance
DEFAULT_DRAFT_RECIPE = ROOT / "configs" / "kimi-k3-dspark.yaml"  # the RadixArk card's draft, the launch's default
DEFAULT_CONTEXT = 131072
RECIPE_READERS = "dspark_sgl.recipes"  # entry-point group: recipe path, target config dict -> DSparkConfig
BYTES = {"float32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

ASSUMPTIONS = (
    "TP: attention heads (MLA q_b/kv_b/o/output gate; KDA q/k/v/g/b/f_b/o, conv, dt_bias, A_log) split over the "
    "attention-TP group = all TP ranks (no DP attention); MLA's fused q_a+kv_a projection, KDA's f_a, the router, "
    "the latent-MoE down/up projections and all norms replicated (SGLang's ReplicatedLinear/RMSNorm).",
    "MoE: EP=1, SGLang's default when the launch sets no --ep-size/--moe-a2a-backend: every rank holds all routed "
    "experts, each expert's intermediate dim split TP ways (the same bytes per rank as EP=TP). Shared experts and "
    "the dense MLP: gate_up column-, down row-parallel over TP.",
    "Embedding and lm_head vocab-parallel (vocab padded to 64 rows).",
    "Quantisation: the config's quantization_config covers the routed experts only (SGLang kimi_k3.py: K3's "
    "checkpoint quantizes only the MoE experts); MXFP4 = 4-bit values + one 1-byte E8M0 scale per group; "
    "everything else in the target's torch_dtype.",
    "KV: one MLA latent (kv_lora_rank + qk_rope_head_dim values) per token per MLA layer in --kv-cache-dtype "
    "(auto = the target's dtype); DCP splits every request's tokens over the DCP ranks.",
    "KDA: state head-sharded over TP; --max-mamba-cache-size + 1 persistent slots; verify scratch for "
    "(--max-running-requests + 1) x (gamma + 1) steps per layer (SGLang's dense conv layout for KDA; "
    "--enable-linear-replayssm-spec drops its SSM part). SSM state in --mamba-ssm-dtype, else the config's "
    "mamba_ssm_dtype, else float32; conv windows bfloat16.",
    "Draft context pool: indexed by SGLang's slot ids, which under DCP span the widened id space (a replicated draft "
    "reads them raw, SGLang kv_cache_configurator.py), so every rank holds the context of every token of every "
    "request: not split by DCP.",
    "Every one of the --max-running-requests requests holds the assumed context length.",
)


@dataclass
class Launch:
    """The flags of the launch that change memory, parsed from the `sglang serve` argument list."""

    model_path: str | None = None
    draft_path: str | None = None
    tp: int = 1
    dcp: int = 1
    max_running: int = 32
    mamba_cache: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    mamba_ssm_dtype: str | None = None
    draft_dtype: str | None = None  # --json-model-override-args {"dspark_draft_dtype": ...}
    replayssm_spec: bool = False  # --enable-linear-replayssm-spec: no per-step SSM snapshots in the verify scratch
    mem_fraction: float | None = None
    gpu_gb: float | None = None  # the GPU's memory in vendor GB (10^9 bytes), for the fit line
    context: int = DEFAULT_CONTEXT

    @classmethod
    def from_args(cls, argv: list[str]) -> tuple[Launch, argparse.Namespace]:
        p = argparse.ArgumentParser(prog="python -m dspark_sgl.sglang.plan", description=__doc__.split("\n")[0])
        p.add_argument("--model-path")
        p.add_argument("--speculative-draft-model-path")
        p.add_argument("--tp-size", "--tp", type=int, default=1)
        p.add_argument("--dcp-size", type=int, default=1)
        p.add_argument("--max-running-requests", type=int, default=32)
        p.add_argument("--max-mamba-cache-size", type=int)
        p.add_argument("--speculative-dspark-block-size", type=int)
        p.add_argument("--kv-cache-dtype", default="auto")
        p.add_argument("--mamba-ssm-dtype")
        p.add_argument("--json-model-override-args", default="{}")
        p.add_argument("--enable-linear-replayssm-spec", action="store_true")
        p.add_argument("--mem-fraction-static", type=float)
        p.add_argument("--gpu-gb", type=float, help="GPU memory in GB (10^9 bytes): print what fits in "
                       "--mem-fraction-static of it")
        p.add_argument("--context-length", type=int, help="SGLang's cap; the plan's context if --context-len is unset")
        p.add_argument("--context-len", type=int, help=f"tokens per running request (default {DEFAULT_CONTEXT})")
        p.add_argument("--draft-recipe", default=str(DEFAULT_DRAFT_RECIPE),
                       help="training recipe whose draft section is planned when no draft folder is given")
        p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
        a, _sglang_only = p.parse_known_args(argv)
        try:
            override = json.loads(a.json_model_override_args or "{}")
        except json.JSONDecodeError as e:
            p.error(f"--json-model-override-args is not JSON: {e}")
        context = a.context_len or a.context_length or DEFAULT_CONTEXT
        launch = cls(a.model_path, a.speculative_draft_model_path, a.tp_size, a.dcp_size, a.max_running_requests,
                     a.max_mamba_cache_size, a.speculative_dspark_block_size, a.kv_cache_dtype, a.mamba_ssm_dtype,
                     override.get("dspark_draft_dtype"), a.enable_linear_replayssm_spec, a.mem_fraction_static,
                     a.gpu_gb, context)
        return launch, a


# ---- the target --------------------------------------------------------------------------------------------------
def _div(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ConfigError(f"{what} = {n} does not split over {parts} ranks")
    return n // parts


def model_dtype(t: dict) -> str:
    """The target's weight dtype as its config.json names it (newer transformers write `dtype`)."""
    return t.get("torch_dtype") or t.get("dtype") or "bfloat16"


def _dtype_bytes(name: str) -> int:
    if name not in BYTES:
        raise ConfigError(f"unknown dtype {name!r}; known: {sorted(BYTES)}")
    return BYTES[name]


def expert_bytes_per_value(t: dict) -> Fraction:
    """Bytes per routed-expert weight value: quantised by the config's quantization_config, else the model dtype."""
    q = t.get("quantization_config")
    if not q:
        return Fraction(_dtype_bytes(model_dtype(t)))
    groups = list((q.get("config_groups") or {}).values()) or [q]
    fmt = str(groups[0].get("format", q.get("format", "")))
    w = groups[0].get("weights", {})
    if "mxfp4" in fmt or "nvfp4" in fmt:  # 4-bit values, one 1-byte scale (E8M0 / E4M3) per group
        return Fraction(1, 2) + Fraction(1, int(w.get("group_size", 32 if "mxfp4" in fmt else 16)))
    raise ConfigError(f"the plan knows MXFP4/NVFP4 expert quantisation only, got format {fmt!r}")


def layer_kinds(t: dict) -> tuple[list[int], list[int]]:
    """0-indexed (KDA layers, MLA layers): `linear_attn_config.kda_layers` is 1-indexed (SGLang is_kda_layer)."""
    kda = {i - 1 for i in (t.get("linear_attn_config") or {}).get("kda_layers", [])}
    L = t["num_hidden_layers"]
    return sorted(kda), [i for i in range(L) if i not in kda]


def target_weights(t: dict, tp: int) -> dict[str, int]:
    """Bytes per rank of each part of a KimiLinear/K3-layout target (KDA + MLA, dense or latent MoE) at TP=tp."""
    b = _dtype_bytes(model_dtype(t))
    H, L = t["hidden_size"], t["num_hidden_layers"]
    V = math.ceil(t["vocab_size"] / 64) * 64
    kda, mla = layer_kinds(t)
    out = {"embed_tokens + lm_head (vocab-parallel)": 2 * _div(V, tp, "vocab") * H * b}
    out["MLA attention"] = len(mla) * mla_layer_bytes(t, tp, b)
    if kda:
        out["KDA attention"] = len(kda) * kda_layer_bytes(t, tp, b)
    dense = [i for i in range(L) if not is_moe_layer(t, i)]
    out["dense MLP"] = len(dense) * 3 * _div(t["intermediate_size"], tp, "intermediate_size") * H * b
    moe = L - len(dense)
    if moe:
        routed, shared, rest = moe_layer_bytes(t, tp, b)
        out["routed experts"] = moe * routed
        out["shared experts"] = moe * shared
        out["router + latent projections"] = moe * rest
    res = 4 if t.get("attn_res_block_size") else 0  # attention residuals: two norms + two 1-row projections a layer
    out["norms"] = (L * (2 + res) + 1 + (2 if res else 0)) * H * b
    return out


def is_moe_layer(t: dict, i: int) -> bool:
    return bool(t.get("num_experts")) and i >= t.get("first_k_dense_replace", 0) and i % t.get("moe_layer_freq", 1) == 0


def mla_layer_bytes(t: dict, tp: int, b: int) -> int:
    H, nh = t["hidden_size"], t["num_attention_heads"]
    qr, kvr, nope, rope, vd = (t[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "v_head_dim"))
    local = _div(nh, tp, "num_attention_heads")
    if qr:
        replicated = H * (qr + kvr + rope) + qr + kvr  # fused q_a + kv_a_with_mqa, q_a / kv_a layernorms
        sharded = qr * local * (nope + rope)  # q_b_proj
    else:
        replicated, sharded = H * (kvr + rope) + kvr, H * local * (nope + rope)
    sharded += kvr * local * (nope + vd) + local * vd * H  # kv_b_proj, o_proj
    if t.get("mla_use_output_gate"):
        sharded += H * local * vd  # g_proj
    return (replicated + sharded) * b


def kda_layer_bytes(t: dict, tp: int, b: int) -> int:
    la, H = t["linear_attn_config"], t["hidden_size"]
    nh, hd, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    local_h = _div(nh, tp, "linear_attn_config.num_heads")
    P = local_h * hd  # this rank's projection width
    gate = H * P if la.get("use_full_rank_gate") else H * hd + hd * P  # full-rank g / low-rank g_a (replicated) + g_b
    bf = (3 * H * P + gate + H * local_h + hd * P + P * H) * b  # q,k,v; g; b_proj; f_b_proj; o_proj
    bf += (H * hd + hd) * b  # f_a_proj (replicated), o_norm
    fp32 = (P + 3 * P * K + local_h) * 4  # dt_bias, qkv_conv1d, A_log
    return bf + fp32


def moe_layer_bytes(t: dict, tp: int, b: int) -> tuple[int, int, int]:
    """(routed experts, shared experts, router + latent projections) bytes per rank of one MoE layer."""
    H, E, inter = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    latent = t.get("routed_expert_hidden_size") or H
    local_inter = _div(inter, tp, "moe_intermediate_size")
    routed = math.ceil(E * 3 * local_inter * latent * expert_bytes_per_value(t))
    shared = 3 * _div(inter * t.get("num_shared_experts", 0), tp, "shared experts' intermediate") * H * b
    rest = E * H * b + E * 4  # router weight (model dtype), e_score_correction_bias (fp32)
    if latent != H:
        rest += (2 * H * latent + (latent if t.get("latent_moe_use_norm") else 0)) * b
    return routed, shared, rest


def kv_cache_bytes(t: dict, tokens: int, dcp: int, kv_dtype: str) -> int:
    """MLA latent KV of `tokens` tokens on one rank: DCP gives each rank 1/dcp of every request's tokens."""
    _, mla = layer_kinds(t)
    b = _dtype_bytes(model_dtype(t) if kv_dtype == "auto" else kv_dtype)
    return math.ceil(tokens / dcp) * len(mla) * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * b


def kda_state_bytes(t: dict, tp: int, ssm_dtype: str, conv_dtype: str = "bfloat16") -> tuple[int, int]:
    """(SSM, conv) bytes of one request slot on one rank, all KDA layers (SGLang KimiLinearStateShape)."""
    kda, _ = layer_kinds(t)
    la = t["linear_attn_config"]
    local_h = _div(la["num_heads"], tp, "linear_attn_config.num_heads")
    ssm = local_h * la["head_dim"] ** 2 * _dtype_bytes(ssm_dtype)
    conv = (la["short_conv_kernel_size"] - 1) * 3 * local_h * la["head_dim"] * _dtype_bytes(conv_dtype)
    return len(kda) * ssm, len(kda) * conv


# ---- the draft ---------------------------------------------------------------------------------------------------
_COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "markov_w1", "markov_w2",
           "embed_tokens")
_ROW = ("o_proj", "down_proj")


def draft_shard_dim(name: str) -> int | None:
    """How a TP-sharded draft would split a parameter, as SGLang lays out a Qwen3 / DeepSeek-V2 layer: heads and MLP
    columns (and the vocabulary rows of the Markov head and an own embedding) split, o_proj/down_proj split along
    their input, everything else (fc/context_proj, MLA down-projections, norms, confidence head) whole."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith("weight") and module in _COLUMN:
        return 0
    if module in _ROW:
        return 1
    return None


def build_meta_draft(cfg: DSparkConfig):
    from dspark_sgl.model.draft import DSparkDraft

    with torch.device("meta"):
        return DSparkDraft(cfg)


def draft_weight_bytes(draft, tp: int, b: int) -> tuple[int, int]:
    """(replicated, TP-sharded) bytes per rank of the draft's own parameters."""
    whole = sharded = 0
    for name, p in draft.named_parameters():
        n = p.numel()
        whole += n * b
        dim = draft_shard_dim(name)
        sharded += (n if dim is None else _div(p.shape[dim], tp, f"draft {name} dim {dim}") * n // p.shape[dim]) * b
    return whole, sharded


def draft_context_per_token(draft, tp: int, b: int) -> tuple[int, int]:
    """(replicated, TP-sharded) context bytes per token, all draft layers. MLA keeps one latent: never split."""
    (nk, dk), (nv, dv) = draft.context_kv_dims()
    L = draft.config.num_hidden_layers
    whole = L * (nk * dk + nv * dv) * b
    if draft.config.is_mla:
        return whole, whole
    return whole, L * (_div(nk, tp, "draft kv heads") * dk + _div(nv, tp, "draft kv heads") * dv) * b


def _shown(path: str | Path) -> str:
    """A path as the printout names it: relative to the project when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def recipe_draft_config(recipe: str, target: dict) -> DSparkConfig:
    """A training recipe's draft section sized for this target, read by the trainer's own code (the training dry
    run's path from a recipe to a draft config), which the `training` package registers as the `dspark_sgl.recipes`
    entry point: dspark_sgl never imports training (the CLI finds `dspark train` the same way)."""
    found = entry_points(group=RECIPE_READERS, name="draft_config")
    if not found:
        raise ConfigError(f"no {RECIPE_READERS!r} entry point to read the recipe {recipe} with: install the project "
                          "(`pip install -e .` registers the training package's), or give "
                          "--speculative-draft-model-path a draft folder with a config.json")
    return next(iter(found)).load()(recipe, target)


def resolve_draft_config(launch: Launch, target: dict, recipe: str) -> tuple[DSparkConfig, str]:
    """The draft folder's config.json when it exists, else the recipe's draft section sized for this target."""
    if launch.draft_path and (Path(launch.draft_path) / "config.json").exists():
        return DSparkConfig.from_pretrained(launch.draft_path), f"{launch.draft_path}/config.json"
    why = f"; {launch.draft_path} has no config.json here" if launch.draft_path else ""
    return recipe_draft_config(recipe, target), f"{_shown(recipe)} (draft section{why})"


def resolve_target_config(launch: Launch) -> tuple[dict, str]:
    if launch.model_path and (Path(launch.model_path) / "config.json").exists():
        return read_target_config(launch.model_path), f"{launch.model_path}/config.json"
    why = f"{launch.model_path} has no config.json here" if launch.model_path else "no --model-path given"
    note = f"{_shown(STAND_IN_TARGET)}/config.json (stand-in: {why})"
    return read_target_config(STAND_IN_TARGET), note


# ---- the plan ----------------------------------------------------------------------------------------------------
def plan(target: dict, draft_cfg: DSparkConfig, launch: Launch) -> dict:
    """Bytes per rank of every part, for a replicated and a TP-sharded draft, plus the per-step collectives."""
    tp, dcp, R, C = launch.tp, launch.dcp, launch.max_running, launch.context
    if dcp > tp or tp % dcp:
        raise ConfigError(f"--dcp-size {dcp} must divide --tp-size {tp}")
    gamma = launch.block_size or draft_cfg.block_size
    tb = _dtype_bytes(t_dtype := model_dtype(target))
    d_dtype = {"auto": "bfloat16"}.get(launch.draft_dtype, launch.draft_dtype)  # auto: bf16 on a GPU (dtypes.py)
    db = _dtype_bytes(d_dtype or t_dtype)
    tokens = R * C
    kv_dtype = t_dtype if launch.kv_cache_dtype == "auto" else launch.kv_cache_dtype
    ssm_dtype = launch.mamba_ssm_dtype or target.get("mamba_ssm_dtype") or "float32"
    target_rows = target_weights(target, tp)
    caches = {"target KV (MLA latent)": kv_cache_bytes(target, tokens, dcp, launch.kv_cache_dtype)}
    if layer_kinds(target)[0]:
        ssm, conv = kda_state_bytes(target, tp, ssm_dtype)
        slots = (launch.mamba_cache if launch.mamba_cache is not None else R) + 1
        caches["KDA state, persistent slots"] = slots * (ssm + conv)
        caches["KDA verify scratch"] = (R + 1) * (gamma + 1) * (conv if launch.replayssm_spec else ssm + conv)

    draft = build_meta_draft(draft_cfg)
    w_rep, w_tp = draft_weight_bytes(draft, tp, db)
    c_rep, c_tp = draft_context_per_token(draft, tp, db)
    V = math.ceil(target["vocab_size"] / 64) * 64
    slot_bytes = tokens * 8  # slot epoch + slot token id, int32 each (context.py, sampling.SlotTokens)
    # _bind_target_heads: at TP > 1 a full all-gathered copy of the target's lm_head; a reduced vocabulary also
    # gathers its K hot rows (in the draft's dtype) at any TP
    head = (V * target["hidden_size"] * tb if tp > 1 else 0)
    head += draft_cfg.draft_vocab * target["hidden_size"] * db if draft_cfg.reduced_vocab else 0
    drafts = {
        "replicated": {"draft weights": w_rep, "gathered target lm_head": head,
                       "draft context pool": tokens * c_rep + slot_bytes,
                       "context gathered per step (transient)": tokens * c_rep},
        "tp-sharded": {"draft weights": w_tp, "gathered target lm_head": 0,
                       "draft context pool": tokens * c_tp + slot_bytes,
                       "context gathered per step (transient)": tokens * c_tp},
    }
    base = sum(target_rows.values()) + sum(caches.values())
    result = {
        "launch": {"tp": tp, "dcp": dcp, "max_running_requests": R, "context_tokens_per_request": C,
                   "gamma": gamma, "kv_cache_dtype": kv_dtype, "mamba_ssm_dtype": ssm_dtype,
                   "target_dtype": t_dtype, "draft_dtype": d_dtype or t_dtype,
                   "max_mamba_cache_size": launch.mamba_cache, "mem_fraction_static": launch.mem_fraction,
                   "gpu_gb": launch.gpu_gb},
        "target_weights": target_rows, "caches": caches, "draft": drafts,
        "total": {k: base + sum(v.values()) for k, v in drafts.items()},
        "collectives": collectives(target, draft_cfg, launch, gamma, tb),
        "assumptions": list(ASSUMPTIONS),
        "target_weights_tp1": sum(target_weights(target, 1).values()),
    }
    if launch.gpu_gb and launch.mem_fraction and C:
        result["fit"] = fit(result, plan(target, draft_cfg, replace(launch, context=0, gpu_gb=None)), launch)
    return result


def fit(p: dict, p0: dict, launch: Launch) -> dict:
    """What fits in --mem-fraction-static of the GPU: fixed bytes (no context), bytes per request-token, and the
    longest context every one of the running requests can hold (SGLang gives the pools whatever is left)."""
    budget = int(launch.gpu_gb * 1e9 * launch.mem_fraction)
    tokens = launch.max_running * launch.context
    out = {"budget": budget}
    for layout, total in p["total"].items():
        fixed = p0["total"][layout]
        per_token = (total - fixed) / tokens
        out[layout] = {"fixed": fixed, "per_token": per_token,
                       "max_context": max(0, int((budget - fixed) / (per_token * launch.max_running)))}
    return out


def collectives(target: dict, cfg: DSparkConfig, launch: Launch, gamma: int, b: int) -> list[dict]:
    """One decode step of `max_running` requests: who communicates what, and whether the step waits on it."""
    R, H, V, L = launch.max_running, target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    W = gamma + 1
    if launch.tp == 1:
        return []  # one rank: nothing to communicate
    own = cfg.own_embed_tokens  # else the target's VocabParallelEmbedding
    rows = [dict(layout="tp-sharded" if own else "both", who="ours", op="all-reduce",
                 what=f"draft embedding of [anchor, MASK x (γ-1)] through {'its own' if own else 'the target'}'s "
                      "vocab-parallel embedding", shape=[R * gamma, H], bytes=R * gamma * H * b, per_step=1,
                 critical=True)]
    rows.append(dict(layout="replicated", who="ours", op="all-gather (start-up only)",
                     what="target lm_head shards, once in _bind_target_heads", shape=[V, H], bytes=V * H * b,
                     per_step=0, critical=False))
    rows.append(dict(layout="tp-sharded", who="ours", op="all-reduce", what="draft o_proj and down_proj outputs",
                     shape=[R * gamma, H], bytes=R * gamma * H * b, per_step=2 * cfg.num_hidden_layers, critical=True))
    rows.append(dict(layout="tp-sharded", who="ours", op="all-gather",
                     what="vocab-sharded draft logits, one per Markov rollout position (each pick needs the "
                          "previous one, so they are sequential)", shape=[R, cfg.draft_vocab],
                     bytes=R * cfg.draft_vocab * b, per_step=gamma, critical=True))
    rows.append(dict(layout="both", who="SGLang", op="all-reduce",
                     what="target verify: attention and MoE outputs, every layer", shape=[R * W, H],
                     bytes=R * W * H * b, per_step=2 * L, critical=True))
    if launch.dcp > 1:
        _, mla = layer_kinds(target)
        rows.append(dict(layout="both", who="SGLang", op="DCP exchange",
                         what="target verify: MLA decode attention over the DCP-split KV (queries gathered, partial "
                              "outputs + LSE combined), every MLA layer", shape=None, bytes=None, per_step=len(mla),
                         critical=True))
    rows.append(dict(layout="both", who="SGLang", op="all-gather", what="target verify logits (vocab-parallel "
                     "lm_head)", shape=[R * W, V], bytes=R * W * V * b, per_step=1, critical=True))
    # ranks.py: rank 0's decisions, one packed int64 broadcast each (tiny, but the next stage waits on it)
    rows.append(dict(layout="both", who="ours", op="broadcast", what="rank 0's draft tokens + verify length per "
                     "request, before the verify", shape=[R, gamma + 1], bytes=R * (gamma + 1) * 8, per_step=1,
                     critical=True))
    rows.append(dict(layout="both", who="ours", op="broadcast", what="rank 0's accepted count + bonus token per "
                     "request, before the commit", shape=[R, 2], bytes=R * 2 * 8, per_step=1, critical=True))
    return rows


# ---- printing ----------------------------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def print_plan(p: dict, sources: dict, out=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=out, width=140)
    la = p["launch"]
    console.print(f"[bold]DSPARK launch plan[/bold]: TP{la['tp']} DCP{la['dcp']}, {la['max_running_requests']} "
                  f"running requests x {la['context_tokens_per_request']:,} tokens, γ={la['gamma']}\n"
                  f"  dtypes: target {la['target_dtype']} (experts as quantised), draft {la['draft_dtype']}, KV "
                  f"{la['kv_cache_dtype']}, KDA SSM state {la['mamba_ssm_dtype']}")
    for k, v in sources.items():
        console.print(f"  {k}: {escape(v)}")
    console.print(f"  target weights, all ranks together: {p['target_weights_tp1'] / GiB:,.1f} GiB")
    t = Table(title="per-rank memory (GiB = 2^30 bytes)")
    t.add_column("part")
    t.add_column("replicated draft", justify="right")
    t.add_column("TP-sharded draft", justify="right")
    gib = lambda n: f"{n / GiB:,.2f}"  # noqa: E731
    for section in ("target_weights", "caches"):
        for name, n in p[section].items():
            t.add_row(name, gib(n), gib(n))
    rep, shd = p["draft"]["replicated"], p["draft"]["tp-sharded"]
    for name in rep:
        t.add_row(name, gib(rep[name]), gib(shd[name]))
    t.add_row("[bold]total per rank[/bold]", gib(p["total"]["replicated"]), gib(p["total"]["tp-sharded"]))
    console.print(t)
    c = Table(title="collectives of one decode step (critical: the step waits on it)")
    for col in ("layout", "who", "op", "what", "shape", "each", "per step", "critical"):
        c.add_column(col)
    for r in p["collectives"]:
        size = "-" if r["bytes"] is None else _size(r["bytes"])
        c.add_row(r["layout"], r["who"], r["op"], escape(r["what"]), str(r["shape"] or "-"), size, str(r["per_step"]),
                  "yes" if r["critical"] else "no")
    console.print(c)
    if "fit" in p:
        f = p["fit"]
        la = p["launch"]
        console.print(f"Fit: --mem-fraction-static {la['mem_fraction_static']} of a {la['gpu_gb']:g} GB GPU = "
                      f"{f['budget'] / GiB:,.1f} GiB per rank")
        for layout in p["total"]:
            x = f[layout]
            console.print(f"  {layout} draft: {x['fixed'] / GiB:,.1f} GiB without context, {x['per_token']:,.0f} B "
                          f"per request-token -> at most {x['max_context']:,} tokens for each of "
                          f"{la['max_running_requests']} requests")
    console.print("Assumptions:")
    for a in p["assumptions"]:
        console.print(textwrap.fill(a, 118, initial_indent="  - ", subsequent_indent="    ", break_on_hyphens=False))


def main(argv: list[str] | None = None) -> int:
    launch, a = Launch.from_args(sys.argv[1:] if argv is None else argv)
    try:
        target, t_src = resolve_target_config(launch)
        draft_cfg, d_src = resolve_draft_config(launch, target, a.draft_recipe)
        p = plan(target, draft_cfg, launch)
    except ConfigError as e:  # a bad recipe arrives as one too (training.target.recipe_draft_config)
        print(f"dry run: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(p | {"sources": {"target": t_src, "draft": d_src}}, indent=1))
    else:
        print_plan(p, {"target config": t_src, "draft config": d_src})
    return 0


if __name__ == "__main__":
    sys.exit(main())
