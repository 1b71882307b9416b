"""Weight-only quantization of a DSpark draft into a compressed-tensors checkpoint (+ a manifest).

Which tensors get which format follows the model cards:
  * fp8 / nvfp4 / mxfp4 (card 000, "identical tensor selection" for every format): every decoder layer's MLP
    gate/up/down, attention o_proj and the q/k/v projections (one fused qkv shard in SGLang/vLLM, so they must
    share a scheme — the GQA counterpart of MLA's q_b_proj), plus the context projection `fc`.
  * --mixed (card 002, o_proj-only MXFP4): the same decoder projections, `fc` left in BF16; each
    `pattern=scheme` pair overrides the format of the modules it matches, `default=scheme` covers the rest.
On an MLA draft (the cards' own Inferact/Kimi-K3 layout) the same cards select `self_attn.q_b_proj` where GQA has
q/k/v, and card 000 adds `context_proj`; card 002 quantizes q_b_proj and kv_b_proj to FP8 (25 FP8 + 5 MXFP4 for
K3). `--recipe NAME` (RECIPES) reproduces each card by name. Fused runtime shards (GQA q/k/v, MLA q_a_proj +
kv_a_proj_with_mqa = `fused_qkv_a_proj`, MLP gate/up) must share a scheme: compressed-tensors refuses a
mixed fused module at load, so the plan refuses it first.
Embeddings (the target's, or an own-embedding draft's `embed_tokens`), the Markov head, every norm and the
confidence head stay BF16; the Markov head's Linear can still be picked by an explicit `--include markov_head.*`,
the confidence head never.

Patterns are shell globs over module names (`layers.*.mlp.*`); a pattern without a wildcard matches a dotted
suffix (`o_proj` = every `*.o_proj`). A pattern that matches nothing is an error, not a silent no-op.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from dspark_sgl.config import DSparkConfig
from dspark_sgl.dtypes import DTYPES
from dspark_sgl.model.formats import (
    BY_COMPRESSION,
    FormatError,
    WeightFormat,
    dequantize_weight,
    get_format,
    quantize_weight,
    weight_snr_db,
)

MANIFEST_FILE = "quantization_manifest.json"
DECODER_PROJECTIONS = tuple(
    f"layers.*.{p}"
    for p in (
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
    )
)
CARD_000_SELECTION = (*DECODER_PROJECTIONS, "fc")  # one format for all (FP8 / NVFP4 / MXFP4 builds)
CARD_002_SELECTION = DECODER_PROJECTIONS  # the mixed o_proj-MXFP4 build keeps fc in BF16
MLA_PROJECTIONS = tuple(
    f"layers.*.{p}" for p in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.q_b_proj")
)
MLA_CARD_000_SELECTION = (*MLA_PROJECTIONS, "context_proj")  # card 000: "2.19 B of 3.56 B params quantized"
MLA_CARD_002_SELECTION = (*MLA_PROJECTIONS, "layers.*.self_attn.kv_b_proj")  # card 002: 5 MXFP4 + 25 FP8
FUSED_SHARDS = (  # one runtime module in vLLM/SGLang: every shard must carry the same scheme
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    ("mlp.gate_proj", "mlp.up_proj"),
)
# The cards' builds by name: (scheme, mixed). Selections follow the draft's attention type.
RECIPES = {
    "kimi-k3-dspark-fp8": ("fp8", None),  # card 000's recommended build (identical selection)
    "kimi-k3-dspark-nvfp4": ("nvfp4", None),  # card 000: kodelow/Kimi-K3-DSpark-NVFP4
    "kimi-k3-dspark-mxfp4": ("mxfp4", None),  # card 000's MXFP4 comparison row
    "kimi-k3-dspark-oproj-mxfp4": (None, "o_proj=mxfp4,default=fp8"),  # card 002: Zhangdanyang/...-OProj-MXFP4
}
PROTECTED = ("markov_head.",)  # picked only by a pattern that names them explicitly
NEVER = ("confidence_head.",)  # scheduling head: fp32 at run time, BF16 on disk, never quantized


class QuantizeError(FormatError):
    """A quantization request that cannot be honoured (bad pattern, bad scheme, already-quantized source)."""


# ---- selection
# ----------------------------------------------------------------------------------------------
def linear_modules(config: DSparkConfig) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of every nn.Linear in a draft built from config (on the meta device: no memory)."""
    from dspark_sgl.model.draft import DSparkDraft

    with torch.device("meta"):
        model = DSparkDraft(config)
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def matches(pattern: str, name: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def _select(pattern: str, names: list[str], what: str) -> list[str]:
    """Modules a user pattern picks; protected heads only when the pattern names them."""
    hits = [n for n in names if matches(pattern, n)]
    hits = [n for n in hits if not n.startswith(PROTECTED) or pattern.startswith(PROTECTED)]
    never = [n for n in hits if n.startswith(NEVER)]
    if never:
        raise QuantizeError(f"{what} {pattern!r} selects {never}: the confidence head is never quantized")
    if not hits:
        raise QuantizeError(f"{what} {pattern!r} matches no quantizable Linear module (have e.g. {names[:4]})")
    return hits


def parse_mixed(spec: str) -> dict[str, str]:
    """'o_proj=mxfp4,default=fp8' -> {'o_proj': 'mxfp4', 'default': 'fp8'} (order kept: first match wins)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise QuantizeError(f"--mixed entry {part!r} is not PATTERN=SCHEME")
        pattern, scheme = (s.strip() for s in part.split("=", 1))
        get_format(scheme)
        out[pattern] = scheme
    if not out:
        raise QuantizeError("--mixed is empty")
    return out


def plan_quantization(
    config: DSparkConfig,
    scheme: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    mixed: dict[str, str] | None = None,
) -> dict[str, WeightFormat]:
    """module name -> format, for every module that gets quantized."""
    if scheme is None and not mixed:
        raise QuantizeError("give --scheme fp8|nvfp4|mxfp4 or --mixed PATTERN=SCHEME[,default=SCHEME]")
    mixed = dict(mixed or {})
    default = mixed.pop("default", scheme)
    names = sorted(linear_modules(config))
    eligible = [n for n in names if not n.startswith(NEVER)]
    if include:
        chosen = {n for p in include for n in _select(p, names, "--include")}
    else:
        if config.is_mla:
            base = MLA_CARD_002_SELECTION if mixed or scheme is None else MLA_CARD_000_SELECTION
        else:
            base = CARD_002_SELECTION if mixed or scheme is None else CARD_000_SELECTION
        chosen = {n for p in base for n in eligible if fnmatch.fnmatchcase(n, p)}
    overrides = {p: _select(p, names, "--mixed pattern") for p in mixed}
    chosen |= {n for hits in overrides.values() for n in hits}
    for p in exclude or []:
        chosen -= set(_select(p, names, "--exclude"))
    plan: dict[str, WeightFormat] = {}
    for n in sorted(chosen):
        fmt = next((mixed[p] for p, hits in overrides.items() if n in hits), default)
        if fmt is not None:
            plan[n] = get_format(fmt)
    if not plan:
        raise QuantizeError("the selection is empty: nothing would be quantized")
    check_fused_shards(plan, names)
    return plan


def check_fused_shards(plan: dict[str, WeightFormat], names: list[str]) -> None:
    """Refuse a plan whose shards of one fused runtime module (FUSED_SHARDS) disagree on their scheme."""
    for i in sorted({int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}):
        for group in FUSED_SHARDS:
            mods = [f"layers.{i}.{g}" for g in group if f"layers.{i}.{g}" in names]
            schemes = {m: plan[m].name if m in plan else "bf16" for m in mods}
            if len(set(schemes.values())) > 1:
                raise QuantizeError(
                    f"fused shards must share a scheme (one runtime module; compressed-tensors refuses mixed "
                    f"shards): {schemes}"
                )


def recipe_arguments(name: str) -> tuple[str | None, str | None]:
    """(scheme, mixed) of a named card recipe."""
    if name not in RECIPES:
        raise QuantizeError(f"unknown --recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]


# ---- compressed-tensors config
# --------------------------------------------------------------------------------
def _targets(modules: list[str], num_layers: int) -> list[str]:
    """Module names as compressed-tensors `re:` targets, one per projection when it covers every layer."""
    by_suffix: dict[str, set[int]] = {}
    singles = []
    for n in modules:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
        if m:
            by_suffix.setdefault(m.group(2), set()).add(int(m.group(1)))
        else:
            singles.append(n)
    out = []
    for suffix, layers in sorted(by_suffix.items()):
        if layers == set(range(num_layers)):
            out.append(rf"re:^(.*\.)?layers\.\d+\.{re.escape(suffix)}$")
        else:
            singles += [f"layers.{i}.{suffix}" for i in sorted(layers)]
    return out + [rf"re:^(.*\.)?{re.escape(n)}$" for n in sorted(singles)]


def _weight_args(fmt: WeightFormat):
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    if fmt.name == "fp8":  # weight-only FP8, per-output-channel fp32 scales (the a16 path)
        return QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    return preset_name_to_scheme({"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[fmt.name], ["Linear"]).weights


def build_quantization_config(plan: dict[str, WeightFormat], all_linear: list[str], num_layers: int) -> dict:
    """The config.json `quantization_config`, validated by compressed-tensors' own pydantic models."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    groups = {}
    formats = sorted({f.compression_format for f in plan.values()})
    for i, cf in enumerate(formats):
        modules = sorted(n for n, f in plan.items() if f.compression_format == cf)
        fmt = BY_COMPRESSION[cf]
        groups[f"group_{i}"] = QuantizationScheme(
            targets=_targets(modules, num_layers), weights=_weight_args(fmt), format=cf
        )
    cfg = QuantizationConfig(
        config_groups=groups,
        format=formats[0] if len(formats) == 1 else "mixed-precision",
        quantization_status="compressed",
        ignore=sorted(n for n in all_linear if n not in plan),
    )
    return cfg.model_dump(mode="json")


# ---- the command
# ----------------------------------------------------------------------------------------------
@dataclass
class QuantizeResult:
    out_dir: Path
    manifest: dict[str, Any] = field(default_factory=dict)




def quantize_draft(
    draft_dir: str | Path,
    out_dir: str | Path,
    scheme: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    mixed: str | dict[str, str] | None = None,
    rest_dtype: str = "bf16",
    recipe: str | None = None,
) -> QuantizeResult:
    """Read a draft folder, write a compressed-tensors folder (config.json, model.safetensors, manifest)."""
    from dspark_sgl.model.checkpoint import read_state_dict

    if recipe is not None:
        if scheme is not None or mixed is not None or include or exclude:
            raise QuantizeError("--recipe fixes the selection: give it alone (no --scheme/--mixed/--include/--exclude)")
        scheme, mixed = recipe_arguments(recipe)

    src, out = Path(draft_dir), Path(out_dir)
    if not (src / "config.json").exists():
        raise QuantizeError(f"{src} is not a draft folder (no config.json)")
    raw_config = json.loads((src / "config.json").read_text())
    if "quantization_config" in raw_config:
        raise QuantizeError(f"{src} is already quantized; quantize the unquantized draft instead")
    if rest_dtype not in DTYPES:
        raise QuantizeError(f"--rest-dtype must be one of {sorted(DTYPES)}, got {rest_dtype!r}")
    if src.resolve() == out.resolve():
        raise QuantizeError("--out must differ from --draft")
    config = DSparkConfig.from_dict(raw_config)
    mixed_map = parse_mixed(mixed) if isinstance(mixed, str) else mixed
    plan = plan_quantization(config, scheme, include, exclude, mixed_map)
    state = read_state_dict(src)
    all_linear = sorted(linear_modules(config))

    tensors: dict[str, Tensor] = {}
    entries: dict[str, Any] = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in plan:
            fmt = plan[module]
            try:
                packed = quantize_weight(t, fmt, name)
            except FormatError as e:
                raise QuantizeError(str(e)) from None
            stored = {f"{module}.{k}": v.contiguous() for k, v in packed.items()}
            tensors.update(stored)
            entries[name] = {
                "scheme": fmt.name,
                "format": fmt.compression_format,
                "shape": list(t.shape),
                "group_size": fmt.group_size,
                "snr_db": round(weight_snr_db(t.float(), dequantize_weight(packed, fmt, name)), 3),
                "stored": {
                    k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in stored.items()
                },
            }
        else:
            tensors[name] = t.to(DTYPES[rest_dtype]).contiguous()
    missing = sorted(f"{m}.weight" for m in plan if f"{m}.weight" not in state)
    if missing:
        raise QuantizeError(f"planned modules have no weight in {src}: {missing}")

    out.mkdir(parents=True, exist_ok=True)
    raw_config["quantization_config"] = build_quantization_config(plan, all_linear, config.num_hidden_layers)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "dspark-sgl"})
    for extra in ("sts.json",):
        if (src / extra).exists():
            shutil.copy2(src / extra, out / extra)
    manifest = _manifest(plan, entries, state, tensors, rest_dtype, scheme, mixed_map, include, exclude)
    manifest["recipe"]["name"] = recipe
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return QuantizeResult(out, manifest)


def _nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _manifest(plan, entries, state, tensors, rest_dtype, scheme, mixed, include, exclude) -> dict[str, Any]:
    by_format: dict[str, list[str]] = {}
    for name, e in sorted(entries.items()):
        by_format.setdefault(e["scheme"], []).append(name)
    kept = sorted(n for n in state if n not in entries)
    by_format[rest_dtype] = kept
    total = sum(t.numel() for t in state.values())
    quantized = sum(state[n].numel() for n in entries)
    return {
        "producer": "dspark-sgl",
        "recipe": {
            "scheme": scheme,
            "mixed": mixed,
            "include": include,
            "exclude": exclude,
            "rest_dtype": rest_dtype,
        },
        "counts": {k: len(v) for k, v in by_format.items()},
        "tensors_by_scheme": by_format,
        "quantized": entries,
        "params": {"total": total, "quantized": quantized, "fraction": round(quantized / max(total, 1), 4)},
        "bytes": {"fp32_source": sum(t.numel() * 4 for t in state.values()), "output": _nbytes(tensors)},
    }
