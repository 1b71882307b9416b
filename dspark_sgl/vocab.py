"""Choosing a reduced draft vocabulary: the K target tokens the draft may propose.

The set comes from the training data itself: how often each target token is a supervised label (under the loss
mask of the — regenerated — samples), plus every EOS/stop token of the target, so a draft can always propose the
end of an answer. A token outside the set is never proposed, and the lossless verification still emits it (the
target's bonus token); the cost is acceptance, which `coverage` estimates: the share of target tokens in a data
set that fall inside the set bounds how often a draft token can match.

File format (`dspark build-vocab --out`): JSON {"draft_vocab_size": K, "vocab_size": V, "target_ids": [...sorted],
"coverage": {...}}.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor


class VocabError(ValueError):
    """A vocabulary request that cannot be met (size, data, file)."""


def token_counts(samples: Iterable[tuple[Sequence[int], Sequence[bool] | None]], vocab_size: int) -> Tensor:
    """int64 [V]: how often each token id is supervised (mask None = every token counts)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if mask is not None:
            t = t[torch.as_tensor([bool(m) for m in mask], dtype=torch.bool)[: t.numel()]]
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise VocabError(f"token id {int(t.max())} is outside the target vocabulary [0, {vocab_size})")
        counts += torch.bincount(t, minlength=vocab_size)
    return counts


def choose_vocab(counts: Tensor, size: int, required: Iterable[int] = ()) -> Tensor:
    """Sorted target ids: the `required` ones (stop tokens), then the most frequent (ties to the lower id)."""
    V = counts.numel()
    req = sorted({int(i) for i in required})
    if not 1 <= size <= V:
        raise VocabError(f"draft vocabulary size must be in [1, {V}], got {size}")
    if len(req) > size:
        raise VocabError(f"{len(req)} required (stop) tokens do not fit a draft vocabulary of {size}")
    if req and (req[0] < 0 or req[-1] >= V):
        raise VocabError(f"required token ids must lie in [0, {V}), got {req}")
    score = counts.double().clone()
    score[req] = float("inf")
    order = torch.sort(-score, stable=True).indices  # stable: equal counts keep ascending ids
    return order[:size].sort().values


def coverage(counts: Tensor, ids: Tensor) -> float:
    """Share of the counted tokens that fall inside the vocabulary (1.0 for an empty count)."""
    total = int(counts.sum())
    return 1.0 if total == 0 else int(counts[ids].sum()) / total


def read_token_samples(path: str | Path) -> list[tuple[list[int], list[bool] | None]]:
    """JSONL of token samples: the trainer's {"input_ids", "loss_mask"} caches, or {"token_ids"} records (generated
    tokens, e.g. `dspark generate --json`; every token counts)."""
    from dspark_sgl.evaluate import iter_jsonl

    out = []
    for n, rec in iter_jsonl(path, "vocabulary data", VocabError, VocabError):
        if "input_ids" in rec and "loss_mask" in rec:
            out.append((rec["input_ids"], rec["loss_mask"]))
        elif "token_ids" in rec:
            out.append((rec["token_ids"], None))
        else:
            raise VocabError(f"{path}:{n} has neither input_ids + loss_mask nor token_ids")
    if not out:
        raise VocabError(f"{path} holds no samples")
    return out


def stop_token_ids(target_dir: str | Path) -> set[int]:
    """The target's EOS / stop ids: tokenizer eos plus generation_config.json eos_token_id (int or list)."""
    ids: set[int] = set()
    for name, key in (("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        f = Path(target_dir) / name
        if f.exists():
            v = json.loads(f.read_text()).get(key)
            ids |= set(v) if isinstance(v, list) else ({v} if v is not None else set())
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
    except (OSError, ValueError):  # no tokenizer files: the config ids are all there is
        pass
    return {int(i) for i in ids}


def save_vocab(path: str | Path, ids: Tensor, vocab_size: int, **info) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"draft_vocab_size": int(ids.numel()), "vocab_size": vocab_size,
                               "target_ids": [int(i) for i in ids], **info}, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_vocab(path: str | Path, size: int | None = None, vocab_size: int | None = None) -> Tensor:
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
        ids = torch.tensor(rec["target_ids"], dtype=torch.long)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise VocabError(f"{path} is not a draft vocabulary file (dspark build-vocab --out): {e}") from e
    if size is not None and ids.numel() != size:
        raise VocabError(f"{path} holds {ids.numel()} tokens but draft_vocab_size is {size}")
    if vocab_size is not None and rec.get("vocab_size", vocab_size) != vocab_size:
        raise VocabError(f"{path} was built for vocab_size={rec.get('vocab_size')}, the target has {vocab_size}")
    return ids


def vocab_from(path: str | Path, size: int, vocab_size: int, target_dir: str | Path | None = None) -> Tensor:
    """A vocabulary file (`dspark build-vocab --out`), or token-sample JSONL to build one from (+ stop tokens)."""
    path = Path(path)
    if path.suffix == ".json":
        return load_vocab(path, size, vocab_size)
    counts = token_counts(read_token_samples(path), vocab_size)
    return choose_vocab(counts, size, stop_token_ids(target_dir) if target_dir is not None else ())
