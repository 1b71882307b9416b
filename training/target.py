"""What the trainer needs from its target: its facts, its frozen heads, the HF model, the completed draft config."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dspark_sgl.config import ConfigError, DSparkConfig, draft_config_for_target, read_target_config
from dspark_sgl.dtypes import resolve_dtype
from dspark_sgl.model.checkpoint import CheckpointError, find_tensors
from dspark_sgl.sglang.engine import EngineError
from training.recipe import Recipe, RecipeError, load_recipe


def resolve_target_path(path: str) -> Path:
    """The one target resolution of the project (`smollm2` or an HF folder), as an engine error."""
    from dspark_sgl.loading import resolve_target_dir

    try:
        return resolve_target_dir(path)
    except FileNotFoundError as e:
        raise EngineError(str(e)) from e


def target_config(recipe: Recipe) -> dict:
    """The target's config.json (or, for a meta dry run of a target not on disk, the recipe's three facts)."""
    t = recipe.target
    if t.hidden_size and t.num_hidden_layers and t.vocab_size:
        return {"hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size}
    return read_target_config(resolve_target_path(t.path))


def draft_config(recipe: Recipe, target: dict) -> DSparkConfig:
    """The recipe's draft section completed from, and validated against, the target."""
    return draft_config_for_target(target, **recipe.draft_dict())


def recipe_draft_config(path: str | Path, target: dict) -> DSparkConfig:
    """A recipe file's draft section sized for a target config dict: the `dspark_sgl.recipes` entry point through
    which the serving dry run (dspark_sgl/sglang/plan.py) reads a recipe, since dspark_sgl never imports training.
    A bad recipe is a ConfigError there, with the recipe's own message."""
    try:
        return draft_config(load_recipe(path), target)
    except RecipeError as e:
        raise ConfigError(str(e)) from None


def load_target_heads(path: Path, dtype: torch.dtype, device) -> tuple[nn.Embedding, nn.Linear]:
    """Only embed_tokens and lm_head from the target's safetensors (a trainer rank never needs the full target)."""
    try:
        found = find_tensors(path, {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight"})
    except CheckpointError as e:
        raise EngineError(str(e)) from None
    if "embed" not in found:
        raise EngineError(f"no *embed_tokens.weight in {path}")
    lm = found.get("lm_head", found["embed"])  # tied embeddings
    embed = nn.Embedding.from_pretrained(found["embed"].to(device, dtype), freeze=True)
    head = nn.Linear(lm.shape[1], lm.shape[0], bias=False).to(device, dtype).requires_grad_(False)
    head.weight.data.copy_(lm)
    return embed, head


def default_device(spec: str, local_rank: int) -> torch.device:
    if spec != "auto":
        return torch.device(spec)
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def target_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    return resolve_dtype(recipe.target.dtype, device, what="target.dtype")


def compute_dtype(recipe: Recipe, device: torch.device) -> torch.dtype:
    """The FSDP parameter dtype (master weights and optimizer state stay fp32)."""
    return resolve_dtype(recipe.train.compute_dtype, device, what="train.compute_dtype")


def load_hf_target(recipe: Recipe, layer_ids: list[int], device: torch.device):
    from dspark_sgl.targets.hf import HFTarget

    return HFTarget.from_pretrained(resolve_target_path(recipe.target.path), layer_ids,
                                    dtype=target_dtype(recipe, device), device=str(device))
