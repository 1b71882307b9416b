"""The canonical DSpark checkpoint folder: config.json + model.safetensors (+ optional sts.json).

Weight names are the ones SGLang, SpecForge and vLLM read (no embedding, no lm_head). Loading accepts an optional
`model.` prefix and the `encoder.*` aliases some exporters write, and reports every missing, unexpected or
mis-shaped tensor by name in one error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.draft import DSparkDraft, check_vocab
from dspark_sgl.model.formats import dequantize_state_dict, export_state_dict

WEIGHTS_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("lm_head.", "embed_tokens.", "rotary_emb.", "model.embed_tokens.")
ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


class CheckpointError(ValueError):
    """A draft folder whose tensors do not match its config."""


def canonical_name(name: str, own_embed: bool = False) -> str | None:
    """The draft's name for a checkpoint tensor, or None for target tensors we do not load (an own-embedding
    draft keeps its `embed_tokens.weight`)."""
    if own_embed and name in ("embed_tokens.weight", "model.embed_tokens.weight"):
        return "embed_tokens.weight"
    if name.startswith(SKIPPED_PREFIXES):
        return None
    name = ALIASES.get(name, name)
    if name.startswith("model.") and not name.startswith("model.markov_head"):
        name = name[len("model."):]
    return name


def safetensors_index(folder: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (shard file, shape) of every tensor in a folder's *.safetensors, from the headers alone.

    The one scanner of weight folders (drafts and targets): a truncated or corrupt shard is a CheckpointError
    naming the file, not a library traceback."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    index.setdefault(name, (f, tuple(st.get_slice(name).get_shape())))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read weights file {f}: {e}") from None
    return index


def read_tensors(index: dict[str, tuple[Path, tuple[int, ...]]], names) -> dict[str, torch.Tensor]:
    """The named tensors of a `safetensors_index`, each shard opened once."""
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n][0], []).append(n)
    out = {}
    for f, ns in by_file.items():
        try:
            with safe_open(str(f), "pt") as st:
                out.update({n: st.get_tensor(n) for n in ns})
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read weights file {f}: {e}") from None
    return out


def find_tensors(folder: str | Path, wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """Tensors whose name is `suffix` or ends with `.suffix`, keyed as `wanted` (key -> suffix); first match wins."""
    index = safetensors_index(folder)
    picked = {}
    for key, suffix in wanted.items():
        hit = next((n for n in index if n == suffix or n.endswith("." + suffix)), None)
        if hit is not None:
            picked[key] = hit
    got = read_tensors(index, picked.values())
    return {key: got[name] for key, name in picked.items()}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a draft folder (every *.safetensors shard), names canonicalised, quantized ones dequantized."""
    folder = Path(path)
    index = safetensors_index(folder)
    if not index:
        raise CheckpointError(f"no *.safetensors weights in {folder}")
    raw = read_tensors(index, index)
    config_json = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    if "quantization_config" in config_json:
        raw = dequantize_state_dict(raw, config_json["quantization_config"])
    out = {}
    own_embed = bool(config_json.get("own_embed_tokens"))
    for name, t in raw.items():
        canon = canonical_name(name, own_embed)
        if canon is not None:
            out[canon] = t
    return vocab_map_from_t2d(out)


def vocab_map_from_t2d(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept the speculators `t2d` [V] bool mask: d2t is derived from it (hot ids in ascending order), or checked
    against it when both are present; t2d itself is dropped (the draft keeps only d2t)."""
    t2d = state.pop("t2d", None)
    if t2d is None:
        return state
    hot = t2d.bool().nonzero().flatten()
    d2t = hot - torch.arange(hot.numel())
    if "d2t" in state and not torch.equal(state["d2t"].long(), d2t):
        raise CheckpointError("d2t and t2d disagree: they describe different draft vocabularies")
    state["d2t"] = d2t
    return state


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(state))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing tensors: {missing}")
        if unexpected:
            parts.append(f"unexpected tensors: {unexpected}")
        if misshaped:
            parts.append(f"mis-shaped tensors: {misshaped}")
        raise CheckpointError("draft weights do not match the config: " + "; ".join(parts))
    bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"draft weights contain NaN/inf in: {bad}")


def trained_block_size(path: str | Path) -> int | None:
    """γ the weights were trained for, as `save_draft` records it (None for folders written by peers)."""
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                value = (st.metadata() or {}).get("block_size")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read weights file {f}: {e}") from None
        if value is not None:
            return int(value)
    return None


def load_draft(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    block_size: int | None = None,
) -> DSparkDraft:
    """Load a draft folder written by us or a peer (SGLang / SpecForge / vLLM layouts).

    The block size is the one the weights were trained for: a config.json that says otherwise is refused, and a
    shorter γ is taken only when asked for explicitly (`block_size`); never a longer one."""
    config = DSparkConfig.from_pretrained(path)
    sts = Path(path) / "sts.json"
    if sts.exists() and config.sts_temperatures is None:
        config.sts_temperatures = json.loads(sts.read_text())["temperatures"]
        config.validate()
    trained = trained_block_size(path) or config.block_size
    if config.block_size != trained:
        raise CheckpointError(f"{path}: config.json says block_size={config.block_size} but the weights were "
                              f"trained for {trained}; fix config.json (ask for a shorter γ with --block-size)")
    if block_size is not None:
        if not 1 <= block_size <= trained:
            raise CheckpointError(f"--block-size must be in [1, {trained}] (the γ the draft was trained for), "
                                  f"got {block_size}")
        config.block_size = block_size
        if config.sts_temperatures is not None:
            config.sts_temperatures = config.sts_temperatures[:block_size]
        config.validate()
    with torch.device("meta"):
        model = DSparkDraft(config)
    state = read_state_dict(path)
    check_state_dict(model, state)
    if config.reduced_vocab:
        state["d2t"] = state["d2t"].long()
        d2t = state["d2t"]
        try:
            check_vocab(torch.arange(d2t.numel()) + d2t, config.draft_vocab, config.vocab_size)
        except ValueError as e:
            raise CheckpointError(f"{path}: d2t is not a draft vocabulary: {e}") from e
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def save_draft(model: DSparkDraft, path: str | Path) -> Path:
    """Write config.json + model.safetensors (contiguous, names exactly as peers read them: `export_state_dict`)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = export_state_dict(model)
    tmp = folder / f".{WEIGHTS_FILE}.tmp"  # written whole, then renamed: an interrupted save leaves no half file
    save_file(state, str(tmp), metadata={"format": "pt", "producer": "dspark-sgl",
                                         "block_size": str(model.config.block_size)})
    tmp.replace(folder / WEIGHTS_FILE)
    return folder
