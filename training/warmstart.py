"""Where the draft's weights start: random, copied from target decoder layers, or an exported draft.

Copying target layers is the cheap half of training on a small budget. The draft's context path is built so a copied
layer sees what it saw inside the target: the context vector hidden_norm(fc(aux)) feeds k_proj/v_proj directly, so
with fc selecting the aux state that entered the copied layer (the output of target layer t−1) and hidden_norm
taking that layer's input_layernorm weight, the draft's context keys and values are the target's own at layer t
(up to the draft's q/k norms, which Llama-style targets lack). The final norm is the target's, so the frozen lm_head
sees hidden states on the scale it was trained for. Only the block rows (anchor + mask embeddings) start off
distribution; that is what training fixes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dspark_sgl.model.checkpoint import find_tensors
from dspark_sgl.model.draft import DSparkDraft

# Draft parameter suffix (inside `layers.i.`) -> target parameter suffix (inside `layers.t.`).
LAYER_PARAMS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",  # Qwen3-style targets only
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
OPTIONAL = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


class WarmStartError(ValueError):
    """The requested initialisation does not fit this draft and target."""


@dataclass
class InitConfig:
    target_layers: list[int] = field(default_factory=list)  # copy these target layers into draft layers 0..n-1
    draft: str | None = None  # or start from an exported DSpark draft folder (fine-tuning a published draft)

    def __post_init__(self) -> None:
        if self.target_layers and self.draft:
            raise WarmStartError("init.target_layers and init.draft are exclusive: pick one starting point")


@torch.no_grad()
def init_from_target(draft: DSparkDraft, target_dir: Path, target_layers: list[int]) -> list[str]:
    """Copy target layers into the draft (see the module docstring). Returns the draft parameter names set."""
    c = draft.config
    if len(target_layers) != c.num_hidden_layers:
        raise WarmStartError(f"init.target_layers names {len(target_layers)} layers but the draft has "
                             f"{c.num_hidden_layers}")
    n_target = c.num_target_layers
    if n_target is not None and not all(0 <= t < n_target for t in target_layers):
        raise WarmStartError(f"init.target_layers {target_layers} must lie in [0, {n_target})")
    wanted = {f"layers.{i}.{p}": f"layers.{t}.{p}" for i, t in enumerate(target_layers) for p in LAYER_PARAMS}
    wanted["norm.weight"] = "norm.weight"
    wanted["hidden_norm.weight"] = f"layers.{target_layers[0]}.input_layernorm.weight"
    found = find_tensors(target_dir, wanted)
    missing = sorted(k for k in wanted if k not in found and k.split(".", 2)[-1] not in OPTIONAL)
    if missing:
        raise WarmStartError(f"target {target_dir} lacks the weights for {missing[:4]}"
                             f"{' …' if len(missing) > 4 else ''} (init.target_layers needs a dense "
                             "Llama/Qwen-style decoder of the draft's shapes)")
    params = dict(draft.named_parameters())
    for name, value in found.items():
        if params[name].shape != value.shape:
            raise WarmStartError(f"target tensor for {name} has shape {tuple(value.shape)}, the draft's is "
                                 f"{tuple(params[name].shape)}: copy needs matching layer shapes")
        params[name].copy_(value)
    # fc selects the aux state that entered the first copied layer: the output of target layer t0 − 1 (else the
    # deepest captured layer below it), so the draft's context K/V start as that layer's own.
    below = [j for j, lid in enumerate(c.target_layer_ids) if lid < target_layers[0]]
    if not below:
        raise WarmStartError(f"init.target_layers starts at {target_layers[0]} but no captured layer "
                             f"({c.target_layer_ids}) lies below it to feed its context")
    j = max(below, key=lambda j: c.target_layer_ids[j])
    H = c.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, j * H:(j + 1) * H].copy_(torch.eye(H))
    return sorted(found) + ["fc.weight"]


def init_from_draft(draft: DSparkDraft, folder: str | Path) -> None:
    """Start from an exported draft of the same config (strict: every tensor, every shape)."""
    src = DSparkDraft.from_pretrained(folder)
    mine, theirs = asdict(draft.config), asdict(src.config)
    diff = {k: (theirs[k], mine[k]) for k in mine if k != "sts_temperatures" and theirs[k] != mine[k]}
    if diff:  # calibration (STS) may differ: it is re-fitted after training anyway
        raise WarmStartError(f"init.draft {folder} has another config than the recipe's draft: {diff}")
    draft.load_state_dict(src.state_dict(), strict=True)


def warm_start(draft: DSparkDraft, cfg: InitConfig, target_dir: Path) -> str:
    """Apply the recipe's init section; returns a one-line description for the log."""
    if cfg.target_layers and draft.config.is_mla:
        raise ValueError("init.target_layers copies Qwen3-style q/k/v layers: an MLA draft has none; start at random")
    if cfg.target_layers:
        init_from_target(draft, target_dir, cfg.target_layers)
        return f"draft layers copied from target layers {cfg.target_layers}"
    if cfg.draft:
        init_from_draft(draft, cfg.draft)
        return f"draft initialised from {cfg.draft}"
    return "draft initialised at random"


@torch.no_grad()
def init_own_embedding(draft: DSparkDraft, target_embed: nn.Module) -> str:
    """A draft with its own embed_tokens (the K3 layout) starts from the target's table, not at std 0.02.

    At 0.02 (6.7x below SmolLM2's 0.133) the tiny MLA recipe's loss swung +-30% per step and did not learn: the
    token embedding fed to the draft layers was far smaller than the context injected beside it. A table of another
    shape is drawn at the target table's standard deviation instead."""
    own, w = draft.embed_tokens.weight, target_embed.weight
    if own.shape == w.shape:
        own.copy_(w.to(own.dtype))
        return "own embed_tokens copied from the target's"
    nn.init.normal_(own, std=float(w.float().std()))
    return f"own embed_tokens drawn at the target table's std {float(w.float().std()):.3f}"

