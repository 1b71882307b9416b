"""`python -m training --config X.yaml --dry-run`: build the run on the meta device, print parameters and memory.

Nothing is allocated and no weights are read: the draft is built on `meta`, sharded with the real `fully_shard` over a
fake process group of the planned world size, and the per-rank memory is added up from the actual local shard sizes
plus the activation and loss-buffer terms of one micro-batch. It validates the recipe against the target facts the
same way a real launch does (layer ids, hidden size, vocabulary, batch divisibility).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from dspark_sgl.model.draft import DSparkDraft
from training.recipe import Recipe, RecipeError
from training.target import compute_dtype, default_device, draft_config, target_config, target_dtype

GiB = 2**30


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def dry_run(recipe: Recipe, world_size: int | None = None, console: Console | None = None) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training.objective import ObjectiveConfig
    from training.trainer import ObjectiveModule, Plan, shard

    console = console or Console()
    t, o = recipe.train, recipe.objective
    W = world_size or t.world_size or 1
    facts = target_config(recipe)
    cfg = draft_config(recipe, facts)
    Plan([], t.seed, t.global_batch, t.micro_batch, W)  # divisibility check
    if dist.is_initialized():
        raise RecipeError("dry-run must run in a fresh process (a process group is already initialised)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
    try:
        with torch.device("meta"):
            draft = DSparkDraft(cfg)
        ctx_name = "context_proj + context_norm" if cfg.is_mla else "fc + hidden_norm"
        parts = {"layers": _count(draft.layers), ctx_name: _count(draft.fc) + _count(draft.hidden_norm),
                 "markov head": _count(draft.markov_head), "norm": _count(draft.norm),
                 "confidence head": _count(draft.confidence_head) if draft.confidence_head else 0}
        if draft.embed_tokens is not None:  # an own (trained) embedding, e.g. the Inferact K3 MLA draft
            parts["embed_tokens (own)"] = _count(draft.embed_tokens)
        total = _count(draft)
        compute = compute_dtype(recipe, default_device(recipe.engine.device, 0))
        module = shard(ObjectiveModule(draft, ObjectiveConfig(**vars(o))), compute, t.reshard_after_forward)
        local = sum(p.to_local().numel() for p in module.parameters())
    finally:
        dist.destroy_process_group()
    mem = memory_plan(recipe, cfg, facts, total, local, W)
    table = Table(title=f"DSpark draft for {recipe.target.path}: {total:,} parameters, {W} ranks")
    table.add_column("part")
    table.add_column("params", justify="right")
    for name, n in parts.items():
        table.add_row(name, f"{n:,}")
    table.add_row("total (trained)", f"{total:,}")
    if draft.embed_tokens is not None:
        table.add_row("total without embed_tokens", f"{total - parts['embed_tokens (own)']:,}")
    table.add_row("local shard, rank 0", f"{local:,}")
    console.print(table)
    mt = Table(title=f"per-rank memory, micro-batch {t.micro_batch} × {recipe.data.max_length} tokens, "
                     f"{o.num_anchors} anchors × γ={cfg.block_size}")
    mt.add_column("item")
    mt.add_column("GiB", justify="right")
    for name, b in mem.items():
        mt.add_row(name, f"{b / GiB:.2f}")
    console.print(mt)
    accum = t.global_batch // (W * t.micro_batch)
    console.print(f"global batch {t.global_batch} = {W} ranks × {accum} accumulation × {t.micro_batch} micro; "
                  f"target layers {cfg.target_layer_ids}; engine {recipe.engine.kind} "
                  f"({recipe.engine.placement}, TP{recipe.engine.tp_size} × {recipe.engine.replicas})")
    return {"total_params": total, "local_params": local, "memory_bytes": mem, "world_size": W}


def memory_plan(recipe: Recipe, cfg, facts: dict, total: int, local: int, W: int) -> dict[str, float]:
    """Bytes per rank. Assumes a fused (flash / memory-efficient) attention kernel: no [heads, Q, K] score matrix."""
    t, o = recipe.train, recipe.objective
    device = default_device(recipe.engine.device, 0)
    cb = torch.tensor([], dtype=compute_dtype(recipe, device)).element_size()
    tb = torch.tensor([], dtype=target_dtype(recipe, device)).element_size()
    H, V, L, S = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, recipe.data.max_length
    B, R = t.micro_batch, o.num_anchors * cfg.block_size
    layer_params = (total - V * cfg.markov_rank * 2 - cfg.num_aux * H * H) / max(L, 1)
    root_params = total - layer_params * L
    kv = cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    if cfg.is_mla:  # the cached context is the latent (kv_lora + rope per token, counted as "2 × kv")
        kv, q = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) / 2, cfg.num_attention_heads * (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    # saved for backward per layer and block row: norms, q/k/v/o inputs and outputs, MLP gate/up/act/down
    act_row = 6 * H + q + 2 * kv + 4 * cfg.intermediate_size
    unsharded_live = (L * layer_params if not t.reshard_after_forward else 2 * layer_params) + root_params
    mem = {
        "fp32 master params (shard)": 4 * local,
        "AdamW m + v (shard)": 8 * local,
        "fp32 grads (shard)": 4 * local,
        f"unsharded {t.compute_dtype} params + grads": 2 * cb * unsharded_live,
        "frozen target embed + lm_head": 2 * V * H * tb,
        "target features in (aux + last)": B * S * (cfg.num_aux + 1) * H * cb,
        "context K/V, all layers": B * L * S * 2 * kv * cb,
        "block activations": B * L * R * act_row * cb,
        "vocab loss chunk (logits, p, q, grad)": 4 * o.vocab_chunk_rows * V * 4,
        "vocab loss saved grads (h, W2)": B * R * H * cb + V * cfg.markov_rank * 4,
    }
    mem["total"] = sum(mem.values())
    return mem
