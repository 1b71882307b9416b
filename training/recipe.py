"""The recipe: one typed config object per training run, read from YAML with `key=value` overrides.

Every section is a pydantic model (or a dataclass the core defines, validated by pydantic the same way), so an
unknown or misspelt key, or a value of the wrong type, is one error naming the key, not a silently ignored setting.
`draft` takes exactly DSparkConfig's fields, every one optional: those the target fixes (hidden size, vocabulary,
number of target layers) are filled from the target at build time and checked against it when given.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, create_model

from dspark_sgl.config import DSparkConfig
from dspark_sgl.dtypes import DTYPE_NAMES
from training.data import DataConfig
from training.objective import ObjectiveConfig
from training.publish import PublishConfig
from training.warmstart import InitConfig

DtypeName = Literal[DTYPE_NAMES]  # "auto" = bf16 only where the device multiplies it natively (dspark_sgl.dtypes)


class RecipeError(ValueError):
    """A recipe that cannot describe a run."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _draft_section() -> type[BaseModel]:
    """DSparkConfig's own fields, each optional: the one definition of a draft, typed, without a copy."""
    hints = typing.get_type_hints(DSparkConfig)
    fields = {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(DSparkConfig)}
    return create_model("DraftSection", __config__=ConfigDict(extra="forbid"), **fields)


DraftSection = _draft_section()


class TargetConfig(Section):
    path: str = "smollm2"  # an HF folder, or "smollm2" for the packaged SmolLM2-135M-Instruct
    dtype: DtypeName = "auto"
    # Fixed by the target; used only by dry-runs that build everything on the meta device (no weights read).
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    vocab_size: int | None = None


class EngineConfig(Section):
    kind: str = "hf"  # hf | sglang
    placement: str = "inprocess"  # inprocess | colocated (one engine process per rank) | disaggregated
    endpoints: list[str] = Field(default_factory=list)  # disaggregated: tcp://host:port of running engines
    device: str = "auto"  # auto = the rank's accelerator, else cpu
    max_batch: int = 8  # samples per prefill call
    tp_size: int = 1  # sglang: tensor parallel size per replica
    replicas: int = 1  # sglang: target replicas serving the trainer ranks
    sglang_url: str | None = None  # sglang: a running capture server (http://host:port) instead of an in-process one
    sglang_args: dict[str, Any] = Field(default_factory=dict)  # sglang: extra sglang.Engine keyword arguments


class StreamConfig(Section):
    credits: int = 8  # requests in flight per rank
    byte_budget_mb: float = 1024.0  # in-flight + buffered hidden-state bytes per rank
    timeout_s: float = 120.0  # no reply from an engine for this long: its requests are re-sent elsewhere
    wire_dtype: str = "bfloat16"  # hidden states on the wire (float32 for exact runs)
    memory_cache_mb: float = 0.0  # keep captures in RAM for later epochs (small multi-epoch runs); 0 = off


# ---- capture transport (issue 15): how hidden-state rows travel from an engine's writer rank to a trainer rank ----
class TransportConfig(Section):
    kind: Literal["zmq", "shm", "dist"] = "zmq"  # zmq: rows in the reply frames | shm: same-host ring | dist: pairs
    host: str | None = None  # dist: this trainer rank's address the engines can reach (default: its host's IP)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # dist: auto = nccl when the trainer rank has a GPU, else gloo


class OptimConfig(Section):
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    clip_grad_norm: float = 1.0
    scale_aux: bool = False  # train fc on per-channel RMS-normalised target states (folded into fc at export)
    # LR multipliers by draft module (issue 40, lever 4), keyed by the module a parameter belongs to (layers, fc,
    # hidden_norm, norm, markov_head, confidence_head, lm_head, ...): e.g. {markov_head: 0.25}; the others keep 1
    lr_scale: dict[str, PositiveFloat] = Field(default_factory=dict)


class TrainLoopConfig(Section):
    out_dir: str = "runs/dspark"
    seed: int = 42
    epochs: float = 1.0
    max_steps: int | None = None
    minutes: float | None = Field(default=None, gt=0)  # wall budget to the end of training (data included)
    global_batch: int = 8  # samples per optimizer step over all ranks
    micro_batch: int = 1  # samples per forward on one rank
    compute_dtype: DtypeName = "auto"  # FSDP param dtype; master weights and optimizer state are fp32
    reshard_after_forward: bool = True  # False = SHARD_GRAD_OP (ZeRO-2)
    save_every: int = 0  # optimizer steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    log_every: int = 1
    threads: int | None = None  # torch intra-op threads per rank
    world_size: int | None = None  # ranks the recipe is planned for (dry-run default; checked at launch)
    wandb_project: str | None = None
    wandb_mode: str = "offline"  # offline | online | disabled
    progress: bool = True


class EvalConfig(Section):
    datasets: list[str] = Field(default_factory=list)  # jsonl files with "turns" (../shared/data/eval/*.jsonl)
    num_prompts: int = 50
    max_new_tokens: int = 256
    temperature: float = 0.0
    dtype: DtypeName = "float32"  # target + draft dtype for the eval (fp32: T=0 identity is exact)
    batch_size: int = 1
    baseline: bool | Literal["first"] = True  # also time plain decoding on the same prompts ("first": first set only)
    threads: int | None = None  # torch threads for the eval (it runs on rank 0 alone: give it the idle cores)
    match: bool = False  # the hybrid (dspark eval --match): each step verifies the draft's block or a match from the
    # request's own text, whichever is expected to commit more (dspark_sgl/speculative/match.py)
    schedule: Literal["static", "confidence"] = "static"  # confidence: verify lengths from the confidence head (STS
    # temperatures from calibrate_prompts, SPS profiled at start for batch_size full windows)
    # STS: fit the confidence head's temperatures (sts.json in the draft folder, read by the confidence schedule) on
    # this many held-out training prompts per data source (data.heldout_prompts), before the eval; 0 = off.
    calibrate_prompts: int = 0


class Recipe(Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    draft: DraftSection = Field(default_factory=DraftSection)  # DSparkConfig fields (validated against the target)
    init: InitConfig = Field(default_factory=InitConfig)  # where the draft's weights start
    data: DataConfig = Field(default_factory=DataConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)  # push drafts into running servers (publish.py)

    def draft_dict(self) -> dict[str, Any]:
        """The draft keys the recipe sets (the rest come from the target)."""
        return self.draft.model_dump(exclude_none=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

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
        if self.engine.placement == "disaggregated" and not self.engine.endpoints:
            raise RecipeError("engine.placement=disaggregated needs engine.endpoints (tcp://host:port of each engine)")
        if self.train.global_batch < 1 or self.train.micro_batch < 1:
            raise RecipeError("train.global_batch and train.micro_batch must be >= 1")
        if self.stream.credits < 1:
            raise RecipeError("stream.credits must be >= 1")
        if self.engine.placement == "disaggregated" and self.engine.replicas != len(self.engine.endpoints):
            raise RecipeError(f"engine.replicas={self.engine.replicas} but {len(self.engine.endpoints)} "
                              "engine.endpoints: list one tcp://host:port per target replica")
        if self.transport.kind != "zmq" and self.engine.placement == "inprocess":
            raise RecipeError(f"transport.kind={self.transport.kind} moves rows from an engine process: set "
                              "engine.placement to colocated or disaggregated")
        return self


# ---- loading -----------------------------------------------------------------------------------------------
def _one_line(e: ValidationError) -> str:
    """The first problem of a pydantic error as `section.key: what (got value)`; unknown keys listed together."""
    errs = e.errors()
    extra = [err for err in errs if err["type"] in ("extra_forbidden", "unexpected_keyword_argument")]
    if extra:
        where = ".".join(str(p) for p in extra[0]["loc"][:-1]) or "recipe"
        names = sorted(str(err["loc"][-1]) for err in extra if ".".join(map(str, err["loc"][:-1])) in (where, ""))
        return f"unknown key(s) {names} in {where}"
    err = errs[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']} (got {err.get('input')!r})"


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
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_one_line(e)) from None
    except (TypeError, ValueError) as e:  # a section's own __post_init__ check
        raise RecipeError(str(e)) from None
    return recipe.validate()
