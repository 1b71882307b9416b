"""Start-up checks of a draft against its target, run before any weight is loaded (no sglang import here).

Each problem gets one clear `ConfigError` naming it, so a bad flag or folder stops `sglang serve` in the launcher
instead of surfacing as a shape error deep in a kernel of the scheduler process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_sgl.config import ConfigError, DSparkConfig, TargetFacts  # noqa: F401 (TargetFacts: re-exported)
from dspark_sgl.model.checkpoint import CheckpointError, canonical_name, safetensors_index
from dspark_sgl.model.draft import DSparkDraft


def check_weights(path: str | Path, config: DSparkConfig) -> None:
    """Every tensor the draft needs is present with its shape (read from safetensors headers only)."""
    try:
        index = safetensors_index(path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not index:
        raise ConfigError(f"draft folder {path} has no *.safetensors weights")
    shapes = {canonical_name(n): shape for n, (_, shape) in index.items() if canonical_name(n) is not None}
    if "t2d" in shapes and "d2t" not in shapes:  # a speculators t2d mask: the loader derives d2t from it
        shapes["d2t"] = (config.draft_vocab,)
    with torch.device("meta"):
        expected = {k: tuple(t.shape) for k, t in DSparkDraft(config).state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ConfigError(f"draft weights in {path} are missing tensors: {missing[:8]}{more}")
    bad = [f"{k}: file {shapes[k]} vs config {expected[k]}" for k in sorted(expected) if shapes[k] != expected[k]]
    if bad:
        raise ConfigError(f"draft weights in {path} do not match its config.json: {bad[:4]}")


def check_draft(
    draft_path: str | Path, target: TargetFacts, block_size: int | None = None, num_draft_tokens: int | None = None
) -> DSparkConfig:
    """The draft config, validated against the target and the command-line block size; raises ConfigError."""
    if not Path(draft_path).is_dir():
        raise ConfigError(f"--speculative-draft-model-path {draft_path} is not a folder")
    config = DSparkConfig.from_pretrained(draft_path)
    config.validate(target.hidden_size, target.num_layers, target.vocab_size)
    if max(config.target_layer_ids) >= target.num_layers - 1:
        raise ConfigError(
            f"target_layer_ids {config.target_layer_ids} include the target's last layer ({target.num_layers - 1}): "
            "SGLang captures a layer's output at the next layer's input, so ids must be < num_layers - 1"
        )
    if block_size is not None and block_size != config.block_size:
        raise ConfigError(
            f"--speculative-dspark-block-size {block_size} does not match the draft's block_size {config.block_size}"
        )
    if num_draft_tokens is not None and num_draft_tokens != config.block_size + 1:
        raise ConfigError(
            f"--speculative-num-draft-tokens {num_draft_tokens} must be block_size + 1 = {config.block_size + 1}"
        )
    check_weights(draft_path, config)
    return config
