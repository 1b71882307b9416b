"""The serving dry run (`serve_kimi_k3.sh --dry-run`, dspark_sgl/sglang/plan.py) against bytes computed by hand.

A 2-layer target (layer 0: KDA attention + dense MLP, layer 1: MLA attention + latent MoE with MXFP4 experts) and a
2-layer GQA draft at TP2 / DCP2, 2 requests of 10 tokens, γ = 3: every part is worked out below from the shapes
SGLang gives the weights, so a wrong sharding, dtype or DCP split shows as a wrong byte count. Then the real launch:
the script's own flags reach the plan, and the card's draft comes out at its published parameter count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_sgl.config import ConfigError, draft_config_for_target
from dspark_sgl.sglang.plan import Launch, plan

ROOT = Path(__file__).resolve().parents[1]
B = 2  # bf16 bytes

TINY_TARGET = {
    "torch_dtype": "bfloat16", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
    "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8, "mla_use_output_gate": True, "intermediate_size": 128, "first_k_dense_replace": 1,
    "num_experts": 4, "num_shared_experts": 1, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True, "attn_res_block_size": 6,
    "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                           "kda_layers": [1]},  # 1-indexed: layer 0 is KDA, layer 1 MLA
    "quantization_config": {"config_groups": {"g": {"format": "mxfp4-pack-quantized",
                                                    "weights": {"num_bits": 4, "group_size": 32}}}},
}
TINY_LAUNCH = Launch(tp=2, dcp=2, max_running=2, mamba_cache=3, block_size=3, context=10)


def tiny_draft():
    return draft_config_for_target(TINY_TARGET, num_aux=1, target_layer_ids=[0], num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   block_size=3, markov_rank=8, mask_token_id=255, enable_confidence_head=True,
                                   confidence_head_with_markov=True)


def hand_computed() -> dict:
    """Bytes per rank at TP2 / DCP2, 2 requests x 10 tokens, γ = 3, every term spelled out."""
    H, tp = 64, 2
    embed_head = 2 * (256 // tp) * H * B  # embed_tokens + lm_head, vocab-parallel
    # MLA, 4 heads -> 2 per rank. Replicated: fused q_a (H x 32) + kv_a (H x (16 + 4)), q_a/kv_a norms (32, 16).
    # Per rank: q_b 32 x 2·(8+4), kv_b 16 x 2·(8+8), o_proj 2·8 x H, output gate H x 2·8.
    mla = (H * (32 + 16 + 4) + 32 + 16 + 32 * 2 * 12 + 16 * 2 * 16 + 2 * 8 * H + H * 2 * 8) * B
    # KDA, 4 heads x 16 -> 2 heads, width 32 per rank: q, k, v, full-rank g (H x 32 each), b_proj (H x 2),
    # f_b (16 x 32), o_proj (32 x H) in bf16; f_a (H x 16, replicated) + o_norm (16) in bf16; dt_bias (32),
    # conv (3·32 x 4) and A_log (2) in fp32.
    kda = (4 * H * 32 + H * 2 + 16 * 32 + 32 * H) * B + (H * 16 + 16) * B + (32 + 3 * 32 * 4 + 2) * 4
    dense = 3 * (128 // tp) * H * B  # layer 0: gate, up, down
    # Layer 1 MoE: 4 experts x (gate, up, down) of 16 (=32/tp) x 32 latent values, MXFP4: half a byte per value
    # plus one byte of scale per 32 values.
    routed = 4 * 3 * 16 * 32 // 2 + 4 * 3 * 16 * 32 // 32
    shared = 3 * (32 // tp) * H * B
    router_latent = 4 * H * B + 4 * 4 + (2 * H * 32 + 32) * B  # router, fp32 bias, latent down/up + latent norm
    norms = (2 * (2 + 4) + 1 + 2) * H * B  # 2 per layer + 4 attention-residual vectors per layer, final + 2 output
    target = embed_head + mla + kda + dense + routed + shared + router_latent + norms

    kv = (2 * 10 // 2) * 1 * (16 + 4) * B  # 20 tokens over DCP2, one MLA layer, 20-value latent
    ssm, conv = 2 * 16 * 16 * 4, 3 * 3 * 32 * B  # one KDA layer per slot: fp32 [2, 16, 16]; bf16 [3, q+k+v]
    kda_slots = (3 + 1) * (ssm + conv)  # --max-mamba-cache-size 3, plus SGLang's padding slot
    scratch = (2 + 1) * (3 + 1) * (ssm + conv)  # (running + 1) x (γ + 1) verify steps
    caches = kv + kda_slots + scratch

    # Draft: fc (H x 1·H) + hidden_norm, 2 layers of [input norm, q (64 x H), k, v (32 x H each), o (H x 64),
    # q/k norms (16 each), post norm, gate/up (128 x H), down (H x 128)], final norm, Markov w1/w2 (256 x 8 each),
    # confidence head (H + 8 weights + 1 bias).
    layer_whole = H + 64 * H + 2 * 32 * H + H * 64 + 2 * 16 + H + 3 * 128 * H
    layer_split = H + (64 * H + 2 * 32 * H + H * 64 + 3 * 128 * H) // tp + 2 * 16 + H
    rest_whole = H * H + H + H + 2 * 256 * 8 + (H + 8 + 1)
    rest_split = H * H + H + H + 2 * 256 * 8 // tp + (H + 8 + 1)
    ctx_whole = 2 * (2 * 16 + 2 * 16) * B  # per token: 2 layers x (2 K heads + 2 V heads) x 16, not DCP-split
    ctx_split = 2 * (1 * 16 + 1 * 16) * B
    tokens = 2 * 10
    draft = {
        "replicated": {"draft weights": (2 * layer_whole + rest_whole) * B, "gathered target lm_head": 256 * H * B,
                       "draft context pool": tokens * (ctx_whole + 8),
                       "context gathered per step (transient)": tokens * ctx_whole},
        "tp-sharded": {"draft weights": (2 * layer_split + rest_split) * B, "gathered target lm_head": 0,
                       "draft context pool": tokens * (ctx_split + 8),
                       "context gathered per step (transient)": tokens * ctx_split},
    }
    return {"target": target, "kv": kv, "kda_slots": kda_slots, "scratch": scratch, "draft": draft,
            "total": {k: target + caches + sum(v.values()) for k, v in draft.items()}}


def test_tiny_plan_equals_the_hand_computation():
    p, want = plan(TINY_TARGET, tiny_draft(), TINY_LAUNCH), hand_computed()
    assert sum(p["target_weights"].values()) == want["target"]
    assert p["caches"] == {"target KV (MLA latent)": want["kv"], "KDA state, persistent slots": want["kda_slots"],
                           "KDA verify scratch": want["scratch"]}
    assert p["draft"] == want["draft"]
    assert p["total"] == want["total"]


def test_tiny_plan_parts_and_fit():
    p = plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "gpu_gb": 1e-3, "mem_fraction": 0.5}))
    w = p["target_weights"]
    assert w["routed experts"] == 4 * 3 * 16 * 32 * 17 // 32  # 0.5 + 1/32 bytes per value
    assert w["dense MLP"] == 3 * 64 * 64 * B
    # 500,000 bytes of budget; per request-token the replicated draft costs KV (20 B/DCP2 rank) + context (256 B)
    # + slot ids (8 B) + the per-step gather (256 B).
    rep = p["fit"]["replicated"]
    assert rep["per_token"] == pytest.approx(20 + 256 + 8 + 256)
    assert rep["max_context"] == int((500_000 - rep["fixed"]) / (540 * 2))


def test_rank_0s_decisions_are_two_small_broadcasts_on_the_critical_path():
    """ranks.py: [anchor drafts + length] and [accepted + bonus] per request, int64, once each per step."""
    rows = [r for r in plan(TINY_TARGET, tiny_draft(), TINY_LAUNCH)["collectives"] if r["op"] == "broadcast"]
    assert [(r["shape"], r["bytes"], r["per_step"], r["critical"]) for r in rows] == [
        ([2, 3 + 1], 2 * 4 * 8, 1, True), ([2, 2], 2 * 2 * 8, 1, True)]


def test_ssm_dtype_and_replayssm_flags_change_the_kda_scratch():
    bf16 = plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "mamba_ssm_dtype": "bfloat16"}))
    assert bf16["caches"]["KDA verify scratch"] == 3 * 4 * (2 * 16 * 16 * 2 + 3 * 3 * 32 * B)
    replay = plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "replayssm_spec": True}))
    assert replay["caches"]["KDA verify scratch"] == 3 * 4 * 3 * 3 * 32 * B  # conv windows only


def test_bad_layouts_are_one_clear_error():
    with pytest.raises(ConfigError, match="dcp-size 3 must divide --tp-size 2"):
        plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "dcp": 3}))
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "tp": 3, "dcp": 1}))


def run_script(*args, **env):
    return subprocess.run(["bash", "launch/serve_kimi_k3.sh", "--dry-run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "K3": "moonshotai/Kimi-K3", **env})


def test_serve_script_dry_run_plans_the_real_launch():
    out = run_script("--json")
    assert out.returncode == 0, out.stderr[-2000:]
    p = json.loads(out.stdout)
    assert {k: p["launch"][k] for k in ("tp", "dcp", "max_running_requests", "max_mamba_cache_size", "gamma",
                                        "mem_fraction_static")} == {
        "tp": 8, "dcp": 8, "max_running_requests": 32, "max_mamba_cache_size": 160, "gamma": 7,
        "mem_fraction_static": 0.85}
    assert "kimi-k3-target" in p["sources"]["target"] and "kimi-k3-dspark.yaml" in p["sources"]["draft"]
    assert p["draft"]["replicated"]["draft weights"] == 2_249_289_601 * B  # RadixArk/Kimi-K3-DSpark's card count
    assert p["total"]["tp-sharded"] < p["total"]["replicated"]


def test_serve_script_dry_run_prints_the_table_and_refuses_bad_flags():
    out = run_script("--gpu-gb", "288")
    assert out.returncode == 0, out.stderr[-2000:]
    for text in ("per-rank memory", "routed experts", "draft context pool", "total per rank", "collectives",
                 "Fit:", "Assumptions:"):
        assert text in out.stdout, text
    bad = run_script(TP="8", DCP="3")
    assert bad.returncode == 2 and "must divide --tp-size 8" in bad.stderr


def test_cli_reads_the_target_and_draft_folders_it_is_given(tmp_path, capsys):
    """`--model-path` / `--speculative-draft-model-path` folders with a config.json replace the stand-in and the
    recipe, and the sglang-only flags of the launch pass through unread."""
    from dspark_sgl.sglang.plan import main

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"text_config": TINY_TARGET}))
    tiny_draft().save_pretrained(tmp_path / "draft")
    assert main(["--trust-remote-code", "--model-path", str(tmp_path / "target"), "--speculative-draft-model-path",
                 str(tmp_path / "draft"), "--tp-size", "2", "--dcp-size", "2", "--max-running-requests", "2",
                 "--max-mamba-cache-size", "3", "--speculative-dspark-block-size", "3", "--context-len", "10",
                 "--reasoning-parser", "kimi_k3", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["sources"] == {"target": f"{tmp_path}/target/config.json", "draft": f"{tmp_path}/draft/config.json"}
    assert p["total"] == hand_computed()["total"]


def test_the_recipe_is_read_through_the_training_entry_point(tmp_path, capsys, monkeypatch):
    """dspark_sgl never imports training: the recipe's draft section comes through the `dspark_sgl.recipes` entry
    point. A bad recipe is still one `dry run:` line, and without the entry point the refusal says what to do."""
    from dspark_sgl.sglang import plan as plan_module

    missing = tmp_path / "missing.yaml"
    assert plan_module.main(["--draft-recipe", str(missing), "--json"]) == 2
    assert capsys.readouterr().err.strip() == f"dry run: recipe {missing} does not exist"
    monkeypatch.setattr(plan_module, "entry_points", lambda **selection: ())
    assert plan_module.main(["--json"]) == 2
    err = capsys.readouterr().err
    assert "no 'dspark_sgl.recipes' entry point" in err and "--speculative-draft-model-path" in err


def test_one_rank_shares_the_target_head_and_embedding():
    p = plan(TINY_TARGET, tiny_draft(), Launch(**{**vars(TINY_LAUNCH), "tp": 1, "dcp": 1}))
    assert p["draft"]["replicated"]["gathered target lm_head"] == 0
    assert p["draft"]["replicated"] == p["draft"]["tp-sharded"] | {"gathered target lm_head": 0}
    assert p["collectives"] == []


def test_the_table_in_the_docs_is_what_the_dry_run_prints():
    """docs/serving.md pastes the output of the command it names; a change to the configs or the plan shows here."""
    doc = (ROOT / "docs" / "serving.md").read_text()
    command = "K3=moonshotai/Kimi-K3 bash launch/serve_kimi_k3.sh --dry-run --gpu-gb 288"
    pasted = doc.split(f"Printed by `{command}`:", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    out = run_script("--gpu-gb", "288")
    assert out.returncode == 0, out.stderr[-2000:]
    assert pasted.strip() == out.stdout.strip()
