"""DSparkConfig: the one typed description of a DSpark draft.

Peers spread the same fields over different places of config.json (SGLang reads them top-level, under
`dspark_config` or `dflash_config`, or `dspark_*`-prefixed inside a target config; SpecForge reads them under
`dflash_config`; vLLM reads `dflash_config`). `from_dict` accepts all of those; `to_dict` writes one canonical
config.json that carries every key each of them reads, with the mask id and layer ids resolved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
ATTENTION_TYPES = ("gqa", "mla")
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DSPARK_KEYS = (
    "block_size",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
)
# Target-bundled form (SGLang `dspark_*` keys inside the target's config.json).
_PREFIXED = {
    "dspark_block_size": "block_size",
    "dspark_markov_rank": "markov_rank",
    "dspark_markov_head_type": "markov_head_type",
    "dspark_noise_token_id": "mask_token_id",
    "dspark_mask_token_id": "mask_token_id",
    "dspark_target_layer_ids": "target_layer_ids",
    "dspark_num_target_layers": "num_target_layers",
    "dspark_confidence_head_with_markov": "confidence_head_with_markov",
    "dspark_enable_confidence_head": "enable_confidence_head",
}


class ConfigError(ValueError):
    """A draft config that cannot describe a working draft (or does not fit its target)."""


@dataclass
class DSparkConfig:
    # Backbone (Qwen3-style). hidden_size must equal the target's: the target embedding/lm_head are shared.
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    # DSpark
    block_size: int = 7  # γ: draft tokens per block
    target_layer_ids: list[int] = field(default_factory=list)  # id i = OUTPUT of target decoder layer i
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True  # anchor is the first prediction position: γ inputs give γ drafts
    sts_temperatures: list[float] | None = None  # per-position confidence temperatures (STS)
    # ---- MLA variant (DeepSeek / Kimi-K3 attention; the Inferact/vLLM `k3_dspark` layout) ----
    attention_type: str = "gqa"  # gqa: Qwen3-style q/k/v; mla: q_a/q_b + kv_a_proj_with_mqa/kv_b, latent context
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    own_embed_tokens: bool = False  # the draft trains its own embed_tokens (saved) instead of borrowing the target's
    # Every block row also reads the context vector of the token before its anchor (ctx[a-1], through the zero-
    # initialised `anchor_proj`): EAGLE's feature-plus-token row, issue 40's lever 1. Ours only (our SGLang worker and
    # reference engine): the stock readers (SGLang's builtin, SpecForge, vLLM, llama.cpp) have no such tensor; our
    # GGUF export refuses it and the builtin gets no row in benchmarks/sglang_speed.py.
    anchor_state: bool = False
    # Reduced draft vocabulary (K hot target tokens, mapped by the checkpoint's `d2t`); None or = vocab_size: full.
    draft_vocab_size: int | None = None
    # The config.json this was read from: the MLA layout writes its keys back unchanged (peers' extra keys kept).
    source: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.draft_vocab_size is not None and int(self.draft_vocab_size) == self.vocab_size:
            self.draft_vocab_size = None  # K = V is the full-vocabulary draft, byte for byte
        self.validate()

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def is_mla(self) -> bool:
        return self.attention_type == "mla"

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None

    @property
    def draft_vocab(self) -> int:
        """K: rows of the draft's lm_head and markov_w2 (V for a full-vocabulary draft)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    def require_full_vocab(self, reader: str) -> None:
        """One clear error for a format that has no draft-to-target map (it would read a K-row head as V rows)."""
        if self.reduced_vocab:
            raise ConfigError(
                f"{reader} cannot hold a reduced-vocabulary draft (draft_vocab_size={self.draft_vocab_size} < "
                f"vocab_size={self.vocab_size}): its format has no d2t map. Use the canonical folder "
                "(dspark-sgl, vLLM/speculators) or train a full-vocabulary draft"
            )

    def validate(
        self,
        target_hidden_size: int | None = None,
        target_num_layers: int | None = None,
        target_vocab_size: int | None = None,
    ) -> DSparkConfig:
        """Raise ConfigError with one clear message for the first problem found."""
        if self.block_size < 1:
            raise ConfigError(f"block_size (γ) must be >= 1, got {self.block_size}")
        self._validate_mla()
        if self.anchor_state and self.is_mla:
            raise ConfigError("anchor_state is not supported for an MLA draft (vLLM's K3 layout has no anchor_proj)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}")
        if self.markov_rank <= 0:
            raise ConfigError(
                f"markov_rank must be > 0 for a DSpark draft (a Markov head is required), got {self.markov_rank}"
            )
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty: the draft needs at least one target layer to condition on")
        if min(self.target_layer_ids) < 0:
            raise ConfigError(f"target_layer_ids must be >= 0, got {self.target_layer_ids}")
        if self.mask_token_id is None:
            raise ConfigError("mask_token_id is missing: set it explicitly (no silent fallback to pad/eos)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        n_layers = target_num_layers or self.num_target_layers
        if n_layers is not None and max(self.target_layer_ids) >= n_layers:
            raise ConfigError(
                f"target_layer_ids {self.target_layer_ids} reach layer {max(self.target_layer_ids)} but the target "
                f"has only {n_layers} layers"
            )
        if target_hidden_size is not None and target_hidden_size != self.hidden_size:
            raise ConfigError(
                f"draft hidden_size={self.hidden_size} != target hidden size {target_hidden_size}: the draft shares "
                "the target's embedding and lm_head, so they must match"
            )
        if target_vocab_size is not None and target_vocab_size != self.vocab_size:
            raise ConfigError(f"draft vocab_size={self.vocab_size} != target vocab size {target_vocab_size}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]"
            )
        if self.sts_temperatures is not None and len(self.sts_temperatures) != self.block_size:
            raise ConfigError(
                f"sts_temperatures has {len(self.sts_temperatures)} entries, expected block_size={self.block_size}"
            )
        return self

    def _validate_mla(self) -> None:
        if self.attention_type not in ATTENTION_TYPES:
            raise ConfigError(f"attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}")
        if not self.is_mla:
            return
        bad = {k: getattr(self, k) for k in MLA_DIMS if not isinstance(getattr(self, k), int) or getattr(self, k) < 1}
        if bad:
            raise ConfigError(f"attention_type=mla needs positive integers for {list(MLA_DIMS)}; got {bad}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    # ---- peer layouts -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        """Build from any peer layout: top-level, text_config, dflash_config, dspark_config (wins), dspark_*."""
        merged: dict[str, Any] = {}
        for source in (raw.get("text_config") or {}, raw):
            merged.update({k: v for k, v in source.items() if not isinstance(v, dict) or k == "rope_scaling"})
        for prefixed, key in _PREFIXED.items():
            if prefixed in raw:
                merged[key] = raw[prefixed]
        top = {k: merged[k] for k in DSPARK_KEYS if k in merged}
        for nested in ("dflash_config", "dspark_config"):  # later wins, as in SGLang
            merged.update(raw.get(nested) or {})
        for k, v in top.items():  # a top-level key that the nested section overrides: no silent winner
            if merged[k] != v:
                where = next(n for n in ("dspark_config", "dflash_config") if k in (raw.get(n) or {}))
                raise ConfigError(f"config.json gives {k}={v!r} and {where}.{k}={merged[k]!r}; make them agree")
        # rope_parameters (transformers 5) carries rope_theta and the scaling dict.
        rope = raw.get("rope_parameters") or (raw.get("text_config") or {}).get("rope_parameters")
        if rope:
            merged.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                merged.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        if _is_mla_layout(raw, merged):
            _from_mla_layout(raw, merged)
        if merged.get("head_dim") is None and "hidden_size" in merged and "num_attention_heads" in merged:
            merged["head_dim"] = merged["hidden_size"] // merged["num_attention_heads"]
        if merged.get("num_key_value_heads") is None and "num_attention_heads" in merged:
            merged["num_key_value_heads"] = merged["num_attention_heads"]
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if n not in merged]
        if missing:
            raise ConfigError(f"draft config is missing required keys: {missing}")
        merged["source"] = raw if merged.get("attention_type") == "mla" else None
        return cls(**{k: v for k, v in merged.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The canonical config.json: Qwen3-style backbone + every DSpark key where each peer reads it.

        An MLA draft writes the Inferact/vLLM `k3_dspark` layout instead (`_mla_layout`)."""
        if self.is_mla:
            return self._mla_layout()
        own = asdict(self)
        for k in ("attention_type", *MLA_DIMS, "source"):
            own.pop(k)
        if not self.own_embed_tokens:
            own.pop("own_embed_tokens")
        if not self.anchor_state:  # a stock draft's config.json stays byte for byte what peers read
            own.pop("anchor_state")
        dspark = {k: own[k] for k in DSPARK_KEYS}
        out: dict[str, Any] = {
            "architectures": ["DSparkDraftModel"],
            "model_type": "qwen3",
            **own,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "num_context_features": self.num_aux,
            "dflash_config": dict(dspark),
            "dspark_config": dict(dspark),
        }
        if out["num_target_layers"] is None:  # SpecForge evaluates it eagerly; max id + 1 is a lower bound
            out["num_target_layers"] = max(self.target_layer_ids) + 1
            for nested in ("dflash_config", "dspark_config"):
                out[nested]["num_target_layers"] = out["num_target_layers"]
        # SpecForge refuses MHA drafts unless told (dspark.py:297).
        out["dflash_config"]["attention_mode"] = (
            "mha" if self.num_key_value_heads == self.num_attention_heads else "gqa"
        )
        if self.sts_temperatures is None:
            out.pop("sts_temperatures")
        if self.draft_vocab_size is None:
            out.pop("draft_vocab_size")
        else:  # vLLM / speculators read it top-level; our loader and SGLang-style readers under dspark_config
            out["dspark_config"]["draft_vocab_size"] = self.draft_vocab_size
        return out

    def _mla_layout(self) -> dict[str, Any]:
        """The `K3DSparkModel` config.json vLLM, TorchSpec and ATOM read (Inferact/Kimi-K3-DSpark). Keys of the
        file this config was read from come back in their order with their values (ours where we own the key);
        our own extras (block size, STS, own embedding...) are written only when set or already present."""
        src = dict(self.source or {})
        rope_key = "rope_scaling" if "rope_scaling" in src else "rope_parameters"
        rope = {**(src.get(rope_key) or {"rope_type": "default"}), **(self.rope_scaling or {})}
        if rope_key == "rope_parameters":  # transformers 5 nests rope_theta; the legacy rope_scaling does not
            rope["rope_theta"] = self.rope_theta
        ours: dict[str, Any] = {
            "architectures": ["K3DSparkModel"],
            "model_type": "k3_dspark",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            **{k: getattr(self, k) for k in MLA_DIMS},
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "num_target_layers": self.num_aux,  # this layout counts the captured layers here
            "target_hidden_size": self.hidden_size,
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "tie_word_embeddings": False,
            "draft_vocab_size": self.draft_vocab,
        }
        if rope_key in src or self.rope_scaling:
            ours[rope_key] = rope
        if self.num_target_layers is not None:
            ours["target_num_hidden_layers"] = self.num_target_layers
        defaults = {"block_size": 7, "sample_from_anchor": True, "own_embed_tokens": False, "hidden_act": "silu",
                    "sts_temperatures": None}
        for k, default in defaults.items():
            if k in src or getattr(self, k) != default:
                ours[k] = getattr(self, k)
        src.update(ours)
        return src

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DSparkConfig:
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        return cls.from_dict(read_json(file, "draft"))

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _is_mla_layout(raw: dict[str, Any], merged: dict[str, Any]) -> bool:
    return (
        merged.get("attention_type") == "mla"
        or raw.get("model_type") == "k3_dspark"
        or "K3DSparkModel" in (raw.get("architectures") or [])
        or (merged.get("kv_lora_rank") is not None and merged.get("attention_type") is None)
    )


def _from_mla_layout(raw: dict[str, Any], merged: dict[str, Any]) -> None:
    """The `k3_dspark` keys onto ours: its `num_target_layers` counts captured layers (ours: the target's depth,
    its `target_num_hidden_layers`); the draft's hidden size must be the target's (shared lm_head)."""
    merged["attention_type"] = "mla"
    unsupported = [k for k in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm") if raw.get(k)]
    if unsupported:
        raise ConfigError(f"MLA variants {unsupported} are not supported (the K3 draft has none of them)")
    if "target_num_hidden_layers" in raw or "K3DSparkModel" in (raw.get("architectures") or []):
        n_aux = raw.get("num_target_layers")
        if n_aux is not None and merged.get("target_layer_ids") and n_aux != len(merged["target_layer_ids"]):
            raise ConfigError(
                f"num_target_layers={n_aux} must equal len(target_layer_ids)={len(merged['target_layer_ids'])} "
                "in the k3_dspark layout (it counts the captured target layers)"
            )
        merged["num_target_layers"] = raw.get("target_num_hidden_layers")
    if raw.get("target_hidden_size", merged.get("hidden_size")) != merged.get("hidden_size"):
        raise ConfigError(
            f"target_hidden_size={raw['target_hidden_size']} != hidden_size={merged.get('hidden_size')}: "
            "the draft shares the target's lm_head"
        )
    if raw.get("draft_vocab_size", merged.get("vocab_size")) != merged.get("vocab_size"):
        raise ConfigError(f"draft_vocab_size={raw['draft_vocab_size']} != vocab_size={merged.get('vocab_size')}")


def default_target_layer_ids(num_target_layers: int, num_aux: int = 5) -> list[int]:
    """Layer ids spread evenly over the target; deep enough targets skip the first and the last two layers
    (the DFlash/DSpark habit: the embedding-like first output and the near-logit last ones carry little)."""
    n = num_target_layers
    start, end = (1, n - 3) if n >= 6 else (0, n - 1)
    k = max(1, min(num_aux, end - start + 1))
    return sorted({start + round(i * (end - start) / max(k - 1, 1)) for i in range(k)})


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A config.json as a dict, or one ConfigError naming the file."""
    if not file.exists():
        raise ConfigError(f"no config.json in the {what} folder {file.parent}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {file} is not a JSON object")
    return raw


# ---- the target side: the one reader of a target's config.json, and the one draft-from-target builder ----------
def read_target_config(path: str | Path) -> dict[str, Any]:
    """A target folder's config.json, `text_config` (multimodal wrappers) lifted to the top level."""
    raw = read_json(Path(path) / "config.json", "target")
    return (raw.get("text_config") or raw) | {k: v for k, v in raw.items() if k != "text_config"}


@dataclass(frozen=True)
class TargetFacts:
    """What a draft must agree with: the target's hidden size, vocabulary and depth."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def from_config_dict(cls, raw: dict) -> TargetFacts:
        text = raw.get("text_config") or raw
        try:
            return cls(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]))
        except KeyError as e:
            raise ConfigError(f"target config.json has no {e.args[0]!r}") from e

    @classmethod
    def from_path(cls, path: str | Path) -> TargetFacts:
        return cls.from_config_dict(read_target_config(path))


def draft_config_for_target(target: dict[str, Any], num_aux: int = 5, **given: Any) -> DSparkConfig:
    """A draft config sized for a target config dict: every key not `given` comes from the target (same hidden
    size, heads and RoPE), target layer ids spread over its depth; validated against the target."""
    facts = TargetFacts.from_config_dict(target)
    unknown = sorted(set(given) - {f.name for f in fields(DSparkConfig)})
    if unknown:
        raise ConfigError(f"unknown draft key(s) {unknown}")
    rope = target.get("rope_parameters") or {}
    inherited = dict(
        hidden_size=facts.hidden_size, vocab_size=facts.vocab_size, num_target_layers=facts.num_layers,
        num_attention_heads=target.get("num_attention_heads"), num_key_value_heads=target.get("num_key_value_heads"),
        intermediate_size=target.get("intermediate_size"), rms_norm_eps=target.get("rms_norm_eps"),
        rope_theta=rope.get("rope_theta", target.get("rope_theta")),
        max_position_embeddings=target.get("max_position_embeddings"),
        target_layer_ids=default_target_layer_ids(facts.num_layers, num_aux),
    )
    kw = {k: v for k, v in inherited.items() if v is not None} | given
    kw.setdefault("num_key_value_heads", kw.get("num_attention_heads"))
    if "num_attention_heads" not in kw or "intermediate_size" not in kw:
        missing = [k for k in ("num_attention_heads", "intermediate_size") if k not in kw]
        raise ConfigError(f"the draft config needs {missing}: neither given nor in the target config")
    kw.setdefault("head_dim", target.get("head_dim") if "num_attention_heads" not in given else None)
    if kw["head_dim"] is None:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    cfg = DSparkConfig(**kw)
    return cfg.validate(target_hidden_size=facts.hidden_size, target_num_layers=facts.num_layers,
                        target_vocab_size=facts.vocab_size)
