"""Bit-exact checks of the E2M1 / E4M3 / E8M0 codecs and the FP8 / NVFP4 / MXFP4 weight formats.

The reference here is deliberately slow and independent: every format's value table is derived from its bit
fields, and encoding scans that table with exact rational arithmetic (ties to the even code, saturation at the
maximum), so a shared mistake with dspark_sgl.model.formats is unlikely.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dspark_sgl.model import formats as F
from tests.conftest import require

# ---- independent reference: value tables from bit fields
# ----------------------------------------------------


def ref_e2m1_value(code: int) -> float:
    sign, exp, man = code >> 3 & 1, code >> 1 & 3, code & 1
    mag = Fraction(man, 2) if exp == 0 else Fraction(2) ** (exp - 1) * (1 + Fraction(man, 2))
    return float(-mag if sign else mag)


def ref_e4m3_value(code: int) -> float:
    sign, exp, man = code >> 7 & 1, code >> 3 & 15, code & 7
    if exp == 15 and man == 7:
        return math.nan
    mag = Fraction(man, 8) * Fraction(2) ** -6 if exp == 0 else (1 + Fraction(man, 8)) * Fraction(2) ** (exp - 7)
    return float(-mag if sign else mag)


def ref_nearest(x: float, codes: range, value, even) -> int:
    """Code of the nearest representable magnitude (ties -> even mantissa), saturating at the largest."""
    a = Fraction(abs(x)) if math.isfinite(x) else None
    finite = [c for c in codes if not math.isnan(value(c))]
    top = max(finite, key=lambda c: value(c))
    if a is None or a >= Fraction(value(top)):
        return top
    best = min(finite, key=lambda c: (abs(Fraction(value(c)) - a), not even(c)))
    return best


def ref_e2m1_encode(x: float) -> int:
    if math.isnan(x):
        raise F.FormatError("nan")
    return ref_nearest(x, range(8), ref_e2m1_value, lambda c: c % 2 == 0) | (8 if math.copysign(1, x) < 0 else 0)


def ref_e4m3_encode(x: float) -> int:
    sign = 0x80 if math.copysign(1, x) < 0 else 0
    if math.isnan(x):
        return 0x7F | sign
    return ref_nearest(x, range(0x7F), ref_e4m3_value, lambda c: c % 2 == 0) | sign


def ref_e8m0_value(code: int) -> float:
    return math.nan if code == 255 else float(Fraction(2) ** (code - 127))


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def interesting_values(values: list[float]) -> list[float]:
    """Every representable value, every midpoint (a tie) and its two float32 neighbours, both signs."""
    finite = sorted({abs(v) for v in values if math.isfinite(v)})
    out = list(finite)
    for lo, hi in zip(finite, finite[1:], strict=False):
        mid = np.float32((lo + hi) / 2)
        out += [
            float(mid),
            float(np.nextafter(mid, np.float32(0))),
            float(np.nextafter(mid, np.float32(np.inf))),
        ]
    out += [finite[-1] * 1.04, finite[-1] * 2, 1e30, math.inf, 0.0]
    return out + [-v for v in out]


# ---- codecs
# -------------------------------------------------------------------------------------------------
def test_e2m1_decode_all_codes_matches_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    assert F.e2m1_decode(codes).tolist() == [ref_e2m1_value(c) for c in range(16)]


def test_e2m1_encode_is_round_nearest_even_saturating():
    xs = interesting_values([ref_e2m1_value(c) for c in range(8)]) + [-0.0]
    ours = F.e2m1_encode(torch.tensor(xs, dtype=torch.float32)).tolist()
    want = [ref_e2m1_encode(float(np.float32(x))) for x in xs]
    assert ours == want
    assert F.e2m1_encode(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [
        0,
        2,
        2,
        4,
        4,
        6,
        6,
    ]


def test_e2m1_rejects_nan():
    with pytest.raises(F.FormatError, match="NaN"):
        F.e2m1_encode(torch.tensor([1.0, math.nan]))


def test_fp4_pack_order_and_round_trip():
    codes = torch.randint(0, 16, (5, 34), dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.shape == (5, 17) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4  # even column in the low nibble
    assert torch.equal(F.unpack_fp4(packed), codes)
    with pytest.raises(F.FormatError, match="even number of columns"):
        F.pack_fp4(codes[:, :3])


def test_e4m3_decode_all_256_codes_incl_nan_and_subnormals():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ours = F.e4m3_decode(codes).tolist()
    want = [ref_e4m3_value(c) for c in range(256)]
    assert [math.isnan(v) for v in ours] == [math.isnan(v) for v in want]
    assert [v for v in ours if not math.isnan(v)] == [v for v in want if not math.isnan(v)]
    assert ours[1] == 2.0**-9 and ours[7] == 7 * 2.0**-9  # subnormals
    assert math.isnan(ours[0x7F]) and math.isnan(ours[0xFF]) and ours[0x7E] == 448.0


def test_e4m3_encode_bit_exact_incl_ties_saturation_nan_and_negative_zero():
    xs = interesting_values([ref_e4m3_value(c) for c in range(0x7F)]) + [math.nan, -math.nan, -0.0, 2.0**-11]
    x32 = torch.tensor(xs, dtype=torch.float32)
    want = [ref_e4m3_encode(float(v)) for v in x32.tolist()]
    assert bits(F.e4m3_encode(x32)) == want


def test_e8m0_decode_all_codes_and_encode_clamps():
    ours = F.e8m0_decode(torch.arange(256, dtype=torch.uint8)).tolist()
    want = [ref_e8m0_value(c) for c in range(256)]
    assert ours[:255] == want[:255] and math.isnan(ours[255])
    assert ours[0] == 2.0**-127 and ours[0] > 0  # an fp32 subnormal, not a flush to zero
    codes = F.e8m0_encode_exponent(torch.tensor([-500, -127, 0, 5, 127, 900]))
    assert codes.tolist() == [0, 0, 127, 132, 254, 254]  # never the NaN code 255


# ---- whole weight formats vs a numpy/value-table reference
# --------------------------------------------------
def _test_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0, :32] = 0.0  # all-zero groups (both group sizes)
    w[1, :32] = torch.randn(32, generator=g) * 5e-6  # scales deep in E4M3's subnormal range
    w[2, 5] = 0.9  # an outlier that sets the NVFP4 global scale
    w[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.01  # FP4 ties after scaling
    return w


def ref_fp8(w: np.ndarray) -> tuple[list[int], np.ndarray]:
    scale = (np.abs(w).max(axis=1, keepdims=True) / np.float32(448)).astype(np.float32)
    scale[scale == 0] = np.finfo(np.float32).eps
    q = (w / scale).astype(np.float32)
    return [ref_e4m3_encode(float(v)) for v in q.flatten()], scale


def ref_nvfp4(w: np.ndarray) -> tuple[list[int], list[int], np.float32]:
    amax = np.float32(np.abs(w).max())
    gs = np.float32(np.float32(448 * 6) / amax)
    g = w.reshape(w.shape[0], -1, 16)
    s = ((np.abs(g).max(-1) / np.float32(6)).astype(np.float32) * gs).astype(np.float32)
    s_codes = [ref_e4m3_encode(float(v)) for v in s.flatten()]
    s8 = np.array([ref_e4m3_value(c) for c in s_codes], dtype=np.float32).reshape(s.shape)
    s8[s8 == 0] = np.float32(0.125)
    s_codes = [ref_e4m3_encode(float(v)) for v in s8.flatten()]
    eff = (s8 / gs).astype(np.float32)
    q = np.clip((g / eff[..., None]).astype(np.float32), -6, 6)
    return [ref_e2m1_encode(float(v)) for v in q.flatten()], s_codes, gs


def ref_mx_exponent(amax: float) -> int:
    if amax == 0:
        return -127
    m, e = math.frexp(amax)  # amax = (2m)·2^(e-1), 2m in [1, 2)
    return max(-127, min(127, (e - 1) + (1 if 2 * m >= 1.75 else 0) - 2))


def ref_mxfp4(w: np.ndarray) -> tuple[list[int], list[int]]:
    g = w.reshape(w.shape[0], -1, 32)
    exps = [[ref_mx_exponent(float(np.abs(grp).max())) for grp in row] for row in g]
    codes, scale_codes = [], []
    for row, row_exps in zip(g, exps, strict=True):
        for grp, e in zip(row, row_exps, strict=True):
            scale_codes.append(e + 127)
            codes += [ref_e2m1_encode(max(-6.0, min(6.0, float(v) / 2.0**e))) for v in grp]
    return codes, scale_codes


def packed_codes(packed: torch.Tensor) -> list[int]:
    return F.unpack_fp4(packed).flatten().tolist()


def test_fp8_weight_format_bit_exact():
    w = _test_weight(8, 64)
    ours = F.quantize_weight(w, F.FP8)
    codes, scale = ref_fp8(w.numpy())
    assert ours["weight"].dtype == torch.float8_e4m3fn and ours["weight_scale"].shape == (8, 1)
    assert bits(ours["weight"]) == codes
    assert np.array_equal(ours["weight_scale"].numpy(), scale)
    deq = F.dequantize_weight(ours, F.FP8)
    want = np.array([ref_e4m3_value(c) for c in codes], dtype=np.float32).reshape(8, 64) * scale
    assert np.array_equal(deq.numpy(), want.astype(np.float32))
    assert (deq[0, :32] == 0).all()


def test_nvfp4_weight_format_bit_exact_incl_zero_and_subnormal_groups():
    w = _test_weight(8, 64)
    ours = F.quantize_weight(w, F.NVFP4)
    codes, s_codes, gs = ref_nvfp4(w.numpy())
    assert ours["weight_packed"].shape == (8, 32) and ours["weight_scale"].shape == (8, 4)
    assert packed_codes(ours["weight_packed"]) == codes
    assert bits(ours["weight_scale"]) == s_codes
    assert float(ours["weight_global_scale"]) == float(gs)
    assert F.e4m3_decode(ours["weight_scale"])[0, :2].tolist() == [0.125, 0.125]  # all-zero groups
    assert 0 < float(F.e4m3_decode(ours["weight_scale"])[1, 0]) < 2.0**-6  # a subnormal E4M3 scale
    deq = F.dequantize_weight(ours, F.NVFP4)
    vals = np.array([ref_e2m1_value(c) for c in codes], dtype=np.float32).reshape(8, 4, 16)
    s8 = np.array([ref_e4m3_value(c) for c in s_codes], dtype=np.float32).reshape(8, 4, 1)
    assert np.array_equal(deq.numpy(), (vals * (s8 / gs).astype(np.float32)).reshape(8, 64))
    assert (deq[0, :32] == 0).all()


def test_mxfp4_weight_format_bit_exact_incl_zero_groups():
    w = _test_weight(8, 64)
    w[4, 32:] = torch.tensor([1.74, 1.75, 3.5, 7.0] * 8)  # the mantissa >= 1.75 round-up rule
    ours = F.quantize_weight(w, F.MXFP4)
    codes, scale_codes = ref_mxfp4(w.numpy())
    assert ours["weight_scale"].dtype == torch.uint8 and ours["weight_scale"].shape == (8, 2)
    assert packed_codes(ours["weight_packed"]) == codes
    assert ours["weight_scale"].flatten().tolist() == scale_codes
    assert int(ours["weight_scale"][0, 0]) == 0  # all-zero group: 2^-127
    deq = F.dequantize_weight(ours, F.MXFP4)
    want = [
        ref_e2m1_value(c) * ref_e8m0_value(s) for c, s in zip(codes, np.repeat(scale_codes, 32).tolist(), strict=True)
    ]
    assert deq.flatten().tolist() == want


@pytest.mark.parametrize("fmt", [F.FP8, F.NVFP4, F.MXFP4])
def test_bad_weights_get_one_clear_error(fmt):
    w = torch.randn(4, 64)
    w[1, 3] = math.nan
    with pytest.raises(F.FormatError, match="NaN/inf"):
        F.quantize_weight(w, fmt, "layers.0.mlp.up_proj.weight")
    w[1, 3] = math.inf
    with pytest.raises(F.FormatError, match="NaN/inf"):
        F.quantize_weight(w, fmt)
    with pytest.raises(F.FormatError, match="2-D"):
        F.quantize_weight(torch.randn(64), fmt)
    if fmt.group_size:
        with pytest.raises(F.FormatError, match="group size"):
            F.quantize_weight(torch.randn(4, 48 if fmt.group_size == 32 else 40), fmt, "x")


def test_weight_snr_matches_card_000_for_gaussian_weights():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    snr = {
        f.name: F.weight_snr_db(w, F.dequantize_weight(F.quantize_weight(w, f), f)) for f in (F.FP8, F.NVFP4, F.MXFP4)
    }
    assert snr["fp8"] > snr["nvfp4"] > snr["mxfp4"]
    assert abs(snr["fp8"] - 31.5) < 1.0 and abs(snr["nvfp4"] - 20.4) < 0.5 and abs(snr["mxfp4"] - 19.0) < 0.5
    assert F.weight_snr_db(w, w.clone()) == math.inf


# ---- the same bytes as compressed-tensors' own compressors
# ----------------------------------------------------
@pytest.mark.parametrize("name", ["fp8", "nvfp4", "mxfp4"])
def test_byte_identical_to_compressed_tensors(name):
    require("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = _test_weight(8, 64)
    w[0, :32] = 1e-3  # the library's CPU FP4 cast drops the sign of exact -0/0 groups; keep them non-zero here
    fmt = F.get_format(name)
    scheme = preset_name_to_scheme({"fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}[name], ["Linear"])
    scheme.input_activations = None
    args = scheme.weights
    if name == "fp8":
        scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        state = {"weight": w, "weight_scale": scale}
    else:
        g = w.unflatten(-1, (-1, fmt.group_size))
        gs = generate_gparam(w.amin(), w.amax()) if name == "nvfp4" else None
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
        state = {"weight": w, "weight_scale": scale} | ({"weight_global_scale": gs} if gs is not None else {})
    compressor = BaseCompressor.get_value_from_registry(fmt.compression_format)
    lib = compressor.compress(state, scheme)
    ours = F.quantize_weight(w, fmt)
    assert sorted(lib) == sorted(ours)
    for k in ours:
        assert lib[k].dtype == ours[k].dtype and bits(lib[k]) == bits(ours[k]), k
    lib_w = compressor.decompress(lib, scheme)["weight"]  # the library rounds NVFP4/MXFP4 output to bf16
    assert torch.equal(F.dequantize_weight(ours, fmt).to(lib_w.dtype), lib_w)
