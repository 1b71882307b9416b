"""The recipe: one typed config object per training run, read from YAML with `key=value` overrides.

Every section is a dataclass, so an unknown or misspelt key is an error naming the key and the keys that exist, not a
silently ignored setting. Draft fields the target fixes (hidden size, vocabulary, number of target layers) are filled
from the target at build time and checked against it when given.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training.data import DataConfig
from training.objective import ObjectiveConfig
from training.warmstart import InitConfig


class RecipeError(ValueError):
    """A recipe that cannot describe a run."""


@dataclass
class TargetConfig:
    path: str = "smollm2"  # an HF folder, or "smollm2" for the packaged SmolLM2-135M-Instruct
    dtype: str = "float32"
    # Fixed by the target; used only by dry-runs that build everything on the meta device (no weights read).
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    vocab_size: int | None = None


@dataclass
class EngineConfig:
    kind: str = "hf"  # hf | sglang
    placement: str = "inprocess"  # inprocess | colocated (one engine process per rank) | disaggregated
    endpoints: list[str] = field(default_factory=list)  # disaggregated: tcp://host:port of running engines
    device: str = "auto"  # auto = the rank's accelerator, else cpu
    max_batch: int = 8  # samples per prefill call
    tp_size: int = 1  # sglang: tensor parallel size per replica
    replicas: int = 1  # sglang: target replicas serving the trainer ranks
    sglang_url: str | None = None  # sglang: a running capture server (http://host:port) instead of an in-process one
    sglang_args: dict[str, Any] = field(default_factory=dict)  # sglang: extra sglang.Engine keyword arguments


@dataclass
class StreamConfig:
    credits: int = 8  # requests in flight per rank
    byte_budget_mb: float = 1024.0  # in-flight + buffered hidden-state bytes per rank
    timeout_s: float = 120.0  # no reply from an engine for this long: its requests are re-sent elsewhere
    wire_dtype: str = "bfloat16"  # hidden states on the wire (float32 for exact runs)
    memory_cache_mb: float = 0.0  # keep captures in RAM for later epochs (small multi-epoch runs); 0 = off


@dataclass
class OptimConfig:
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    clip_grad_norm: float = 1.0
    scale_aux: bool = False  # train fc on per-channel RMS-normalised target states (folded into fc at export)


@dataclass
class TrainLoopConfig:
    out_dir: str = "runs/dspark"
    seed: int = 42
    epochs: float = 1.0
    max_steps: int | None = None
    global_batch: int = 8  # samples per optimizer step over all ranks
    micro_batch: int = 1  # samples per forward on one rank
    compute_dtype: str = "bfloat16"  # FSDP param dtype; master weights and optimizer state are fp32
    reshard_after_forward: bool = True  # False = SHARD_GRAD_OP (ZeRO-2)
    save_every: int = 0  # optimizer steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    log_every: int = 1
    threads: int | None = None  # torch intra-op threads per rank
    world_size: int | None = None  # ranks the recipe is planned for (dry-run default; checked at launch)
    wandb_project: str | None = None
    wandb_mode: str = "offline"  # offline | online | disabled
    progress: bool = True


@dataclass
class EvalConfig:
    datasets: list[str] = field(default_factory=list)  # jsonl files with "turns" (../shared/data/eval/*.jsonl)
    num_prompts: int = 50
    max_new_tokens: int = 256
    temperature: float = 0.0
    dtype: str = "float32"  # target + draft dtype for the eval
    batch_size: int = 1
    baseline: bool = True  # also time plain target decoding on the same prompts (the speed ratio)
    threads: int | None = None  # torch threads for the eval (it runs on rank 0 alone: give it the idle cores)


@dataclass
class Recipe:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: dict[str, Any] = field(default_factory=dict)  # DSparkConfig fields (validated against the target)
    init: InitConfig = field(default_factory=InitConfig)  # where the draft's weights start
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def draft_dict(self) -> dict[str, Any]:
        return dict(self.draft)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> Recipe:
        if self.engine.kind not in ("hf", "sglang"):
            raise RecipeError(f"engine.kind must be 'hf' or 'sglang', got {self.engine.kind!r}")
        if self.engine.placement not in ("inprocess", "colocated", "disaggregated"):
            raise RecipeError(f"engine.placement must be inprocess|colocated|disaggregated, got "
                              f"{self.engine.placement!r}")
        if self.engine.kind == "sglang" and self.engine.placement == "inprocess":
            raise RecipeError("engine.kind=sglang runs in an engine process: set engine.placement to colocated or "
                              "disaggregated")
        if self.engine.sglang_url is not None and not self.engine.sglang_url.startswith(("http://", "https://")):
            raise RecipeError(f"engine.sglang_url must be http://host:port, got {self.engine.sglang_url!r}")
        if not isinstance(self.engine.sglang_args, dict):
            raise RecipeError(f"engine.sglang_args must be a mapping of sglang.Engine arguments, got "
                              f"{self.engine.sglang_args!r}")
        if self.engine.placement == "disaggregated" and not self.engine.endpoints:
            raise RecipeError("engine.placement=disaggregated needs engine.endpoints (tcp://host:port of each engine)")
        if self.train.global_batch < 1 or self.train.micro_batch < 1:
            raise RecipeError("train.global_batch and train.micro_batch must be >= 1")
        if self.train.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise RecipeError(f"train.compute_dtype must be float32|bfloat16|float16, got {self.train.compute_dtype}")
        if self.stream.credits < 1:
            raise RecipeError("stream.credits must be >= 1")
        return self


# ---- loading -----------------------------------------------------------------------------------------------
def _build(cls, raw: Any, where: str):
    if not dataclasses.is_dataclass(cls):
        return raw
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise RecipeError(f"{where or 'recipe'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise RecipeError(f"unknown key(s) {unknown} in {where or 'recipe'}; known: {sorted(names)}")
    kwargs = {}
    for k, v in raw.items():
        t = hints[k]
        sub = where + "." + k if where else k
        if dataclasses.is_dataclass(t):
            kwargs[k] = _build(t, v, sub)
        else:
            kwargs[k] = _coerce(t, v, sub)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where or 'recipe'}: {e}") from e


def _coerce(t, v, where: str):
    """Light type check: YAML gives the right scalar types; we turn lists into tuples and reject obvious mismatches."""
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if v is None:
        return v
    if origin in (types.UnionType, typing.Union):
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, v, where)
            except RecipeError:
                continue
        raise RecipeError(f"{where}: value {v!r} does not fit {t}")
    if origin is tuple:
        return tuple(v)
    if t is float and isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if t is float and isinstance(v, str):  # PyYAML reads "3e-3" (no dot) as a string
        try:
            return float(v)
        except ValueError:
            raise RecipeError(f"{where}: expected a number, got {v!r}") from None
    if t in (int, str, bool) and not isinstance(v, t):
        raise RecipeError(f"{where}: expected {t.__name__}, got {v!r}")
    if t is int and isinstance(v, bool):
        raise RecipeError(f"{where}: expected int, got {v!r}")
    return v


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"override {item!r} is not key=value")
    key, value = item.split("=", 1)
    return key.split("."), yaml.safe_load(value) if value != "" else None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise RecipeError(f"recipe {p} does not exist")
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict):
            raise RecipeError(f"recipe {p} must be a YAML mapping")
    for item in overrides or []:
        keys, value = parse_override(item)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {item!r}: {k} is not a section")
        node[keys[-1]] = value
    return _build(Recipe, raw, "").validate()
