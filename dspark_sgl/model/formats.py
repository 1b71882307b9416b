"""The three weight-only number formats, bit-exact, in the compressed-tensors on-disk layout.

    FP8  float-quantized        weight F8_E4M3 [out, in]        weight_scale F32 [out, 1] (per channel)
    NVFP4 nvfp4-pack-quantized  weight_packed U8 [out, in/2]    weight_scale F8_E4M3 [out, in/16]
                                weight_global_scale F32 [1]
    MXFP4 mxfp4-pack-quantized  weight_packed U8 [out, in/2]    weight_scale U8 (E8M0) [out, in/32]

Element codes: E2M1 is sign(bit 3) + 3-bit magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}; two codes per
byte, the even column in the low nibble. E4M3FN has no inf, NaN = S.1111.111, max 448. E8M0 is a bare biased
exponent, 2^(c-127), 255 = NaN. Rounding is to nearest, ties to even, saturating at the format max.

The scale recipes mirror compressed-tensors 0.20 (`calculate_qparams`, `generate_gparam`,
`generate_mx_scales`) operation for operation, so a checkpoint written here is byte-identical to the library's
own compressors' output (tests/test_quant_formats.py checks that), while the codecs themselves are ours: the
library's CPU FP4 cast maps NaN to garbage and drops the sign of -0, and its decompressors round NVFP4 weights
to bf16; ours dequantize exactly in fp32, which the drift analysis needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Midpoints between neighbouring E2M1 magnitudes; a value exactly on one goes to the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class FormatError(ValueError):
    """A tensor that a number format cannot represent (NaN into E2M1, a shape the grouping cannot split)."""


# ---- E2M1 (FP4) -------------------------------------------------------------------------------------------
def e2m1_encode(x: Tensor) -> Tensor:
    """Float tensor -> uint8 codes 0..15 (round to nearest even, |x| > 6 saturates, -0 keeps its sign)."""
    if torch.isnan(x).any():
        raise FormatError("E2M1 has no NaN encoding: the input contains NaN")
    x = x.float()
    mag = x.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    lower = torch.bucketize(mag, mids, right=False)  # a tie lands on the smaller magnitude
    upper = torch.bucketize(mag, mids, right=True)  # ... or on the larger one
    code = torch.where(lower % 2 == 0, lower, upper)  # they differ only on ties: keep the even code
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: Tensor) -> Tensor:
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """[m, n] codes -> [m, n/2] bytes, column 2j in the low nibble (compressed-tensors' order)."""
    if codes.shape[-1] % 2:
        raise FormatError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    if packed.dtype != torch.uint8:
        raise FormatError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ---- E4M3FN (FP8) -----------------------------------------------------------------------------------------
def e4m3_encode(x: Tensor) -> Tensor:
    """Float tensor -> float8_e4m3fn, saturating at ±448 (inf included); NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(x: Tensor) -> Tensor:
    return x.float()


# ---- E8M0 (MX block scale) --------------------------------------------------------------------------------
def e8m0_decode(codes: Tensor) -> Tensor:
    """uint8 biased exponents -> fp32 2^(c-127); 0 decodes to 2^-127 (an fp32 subnormal), 255 to NaN."""
    exp = codes.to(torch.int32) - E8M0_BIAS
    value = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=codes.device), exp.double()).float()
    return torch.where(codes == E8M0_NAN, torch.tensor(float("nan"), device=codes.device), value)


def e8m0_encode_exponent(exponent: Tensor) -> Tensor:
    """Unbiased integer exponents -> uint8 codes, clamped to the finite range [-127, 127]."""
    return (exponent.to(torch.int32) + E8M0_BIAS).clamp(0, E8M0_NAN - 1).to(torch.uint8)


# ---- the weight formats -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    name: str  # our scheme name (CLI)
    compression_format: str  # compressed-tensors CompressionFormat value
    group_size: int | None  # None = per output channel


FP8 = WeightFormat("fp8", "float-quantized", None)
NVFP4 = WeightFormat("nvfp4", "nvfp4-pack-quantized", 16)
MXFP4 = WeightFormat("mxfp4", "mxfp4-pack-quantized", 32)
FORMATS = {f.name: f for f in (FP8, NVFP4, MXFP4)}
BY_COMPRESSION = {f.compression_format: f for f in (FP8, NVFP4, MXFP4)}


def get_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise FormatError(f"unknown quantization scheme {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def _check_weight(w: Tensor, fmt: WeightFormat, name: str) -> Tensor:
    if w.dim() != 2:
        raise FormatError(f"{name}: {fmt.name} quantizes 2-D Linear weights, got shape {tuple(w.shape)}")
    if fmt.group_size and w.shape[1] % fmt.group_size:
        raise FormatError(
            f"{name}: in_features={w.shape[1]} is not a multiple of the {fmt.name} group size {fmt.group_size}"
        )
    if not torch.isfinite(w).all():
        raise FormatError(f"{name}: weight contains NaN/inf; refusing to quantize it")
    return w.float()


def _groups(w: Tensor, size: int) -> Tensor:
    return w.unflatten(-1, (-1, size))  # [out, in/size, size]


def quantize_fp8(w: Tensor) -> dict[str, Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return {"weight": e4m3_encode(w / scale), "weight_scale": scale}


def nvfp4_global_scale(w: Tensor) -> Tensor:
    """448·6 / amax(w): maps the largest group's FP4 scale to the top of the E4M3 range (fp32, shape [1])."""
    amax = w.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    gs = torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.float().reshape(1)


def quantize_nvfp4(w: Tensor) -> dict[str, Tensor]:
    gs = nvfp4_global_scale(w)
    scale = e4m3_encode(_groups(w, 16).abs().amax(-1) / E2M1_MAX * gs).float()  # [out, in/16]
    scale = torch.where(scale == 0, 0.125, scale)  # E4M3 "eps" of compressed-tensors: all-zero groups
    q = _groups(w, 16) / (scale / gs)[..., None]
    codes = e2m1_encode(q.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2))
    return {
        "weight_packed": pack_fp4(codes),
        "weight_scale": scale.to(torch.float8_e4m3fn),
        "weight_global_scale": gs,
    }


def mx_scale_exponent(amax: Tensor) -> Tensor:
    """E8M0 exponent per MX group: floor(log2(amax rounded up to 2^k when its mantissa >= 1.75)) - 2."""
    bits = amax.float().contiguous().view(torch.int32)
    rounded = ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32)  # keep sign+exponent, round 1.75 up
    exponent = torch.floor(torch.log2(rounded)) - 2  # E2M1 max 6 = 1.5·2^2
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).nan_to_num(nan=-E8M0_BIAS, neginf=-E8M0_BIAS)


def quantize_mxfp4(w: Tensor) -> dict[str, Tensor]:
    codes_scale = e8m0_encode_exponent(mx_scale_exponent(_groups(w, 32).abs().amax(-1)))
    q = _groups(w, 32) / e8m0_decode(codes_scale)[..., None]
    codes = e2m1_encode(q.clamp(-E2M1_MAX, E2M1_MAX).flatten(-2))
    return {"weight_packed": pack_fp4(codes), "weight_scale": codes_scale}


def quantize_weight(w: Tensor, fmt: WeightFormat, name: str = "weight") -> dict[str, Tensor]:
    """One Linear weight -> its compressed-tensors tensors (local names: weight[_packed], weight_scale...)."""
    w = _check_weight(w, fmt, name)
    return {"fp8": quantize_fp8, "nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}[fmt.name](w)


def dequantize_weight(tensors: dict[str, Tensor], fmt: WeightFormat, name: str = "weight") -> Tensor:
    """The exact fp32 weight a format's tensors stand for (no intermediate bf16 rounding)."""
    try:
        if fmt.name == "fp8":
            return e4m3_decode(tensors["weight"]) * tensors["weight_scale"].float()
        values = e2m1_decode(unpack_fp4(tensors["weight_packed"]))
        scale = tensors["weight_scale"]
        if fmt.name == "nvfp4":
            group = e4m3_decode(scale) / tensors["weight_global_scale"].float()
        else:
            group = e8m0_decode(scale)
    except KeyError as e:
        raise FormatError(f"{name}: {fmt.compression_format} tensors are missing {e.args[0]!r}") from None
    if values.shape[1] != group.shape[1] * fmt.group_size:
        raise FormatError(
            f"{name}: {values.shape[1]} columns do not match {group.shape[1]} scales of group {fmt.group_size}"
        )
    return (_groups(values, fmt.group_size) * group[..., None]).flatten(-2)


def weight_snr_db(reference: Tensor, candidate: Tensor) -> float:
    """10·log10(Σw² / Σ(w-ŵ)²); inf when exact."""
    err = (reference.double() - candidate.double()).pow(2).sum()
    sig = reference.double().pow(2).sum()
    return float("inf") if err == 0 else float(10 * torch.log10(sig / err))


_LOCAL_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "weight_zero_point",
    "weight_shape",
    "input_scale",
    "input_global_scale",
    "input_zero_point",
    "output_scale",
)


# ---- dequantization (the loader's side)
# -----------------------------------------------------------------------
def _target_matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, "Linear") or module.endswith("." + target)


def _group_format(group: dict, top_format: str | None, module: str) -> WeightFormat:
    cf = group.get("format") or top_format
    weights = group.get("weights") or {}
    fmt = BY_COMPRESSION.get(cf)
    if cf in ("naive-quantized",) and weights.get("num_bits") == 8 and weights.get("type") == "float":
        fmt = BY_COMPRESSION["float-quantized"]
    if fmt is None:
        raise FormatError(
            f"{module}: compressed-tensors format {cf!r} is not supported here (supported: {sorted(BY_COMPRESSION)})"
        )
    if fmt.group_size is not None and weights.get("group_size") != fmt.group_size:
        raise FormatError(
            f"{module}: {cf} needs group_size {fmt.group_size}, config says {weights.get('group_size')}"
        )
    if fmt.name == "fp8" and weights.get("strategy") not in ("channel", "tensor"):
        raise FormatError(f"{module}: FP8 strategy {weights.get('strategy')!r} is not supported (channel, tensor)")
    return fmt


def dequantize_state_dict(raw_state: dict[str, Tensor], quantization_config: dict[str, Any]) -> dict[str, Tensor]:
    """A compressed-tensors state dict -> plain fp32 `.weight`s of its quantized modules (rest untouched)."""
    if quantization_config.get("quant_method", "compressed-tensors") != "compressed-tensors":
        raise FormatError(f"quant_method {quantization_config.get('quant_method')!r} is not compressed-tensors")
    groups = list((quantization_config.get("config_groups") or {}).values())
    modules = sorted({k.rsplit(".", 1)[0] for k in raw_state if k.endswith((".weight_packed", ".weight_scale"))})
    out = dict(raw_state)
    for module in modules:
        hits = [g for g in groups if any(_target_matches(t, module) for t in g.get("targets", []))]
        if not hits and len(groups) == 1:
            hits = groups
        if not hits:
            raise FormatError(f"{module} has quantized tensors but no config group targets it")
        fmt = _group_format(hits[0], quantization_config.get("format"), module)
        local = {s: out.pop(f"{module}.{s}") for s in (*_LOCAL_SUFFIXES, "weight") if f"{module}.{s}" in out}
        try:
            out[f"{module}.weight"] = dequantize_weight(local, fmt, module)
        except FormatError as e:
            raise FormatError(str(e)) from None
    return out


# ---- the export (the tensors a draft folder holds)
# ---------------------------------------------------------------------------------------------
def export_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The tensors `save_draft` writes: the draft's own state dict, contiguous on the CPU, and for a reduced-vocabulary
    draft bound to its target also `lm_head.weight`, the target's K hot lm_head rows (in d2t order).

    vLLM's `Qwen3DSparkForCausalLM` refuses a reduced-vocabulary folder without that K-row head (it cannot share the
    target's V-row one); our loader, SGLang and the GGUF export skip `lm_head.*`, so a full-vocabulary folder stays
    byte-identical and a reduced one only gains the tensor vLLM reads (docs/interop.md)."""
    from dspark_sgl.faults import planted

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model, "_target", None) is not None and model.config.reduced_vocab:
        rows = model.head_weight().detach()  # the draft's dtype, like the K-row markov_w2 beside it
        state["lm_head.weight"] = rows.to(model.markov_head.markov_w2.weight.dtype).contiguous().cpu()
    if planted("export_transpose"):  # one square tensor written transposed: same shape, so every loader takes it
        name = "layers.0.self_attn.o_proj.weight"
        state[name] = state[name].t().contiguous()
    if planted("export_d2t") and "d2t" in state:  # the last draft id mapped one target id too far (still distinct)
        state["d2t"] = state["d2t"].clone()
        state["d2t"][-1] += 1
    return state
