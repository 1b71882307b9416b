"""`auto` follows the CPU's bf16 capability (flags), CUDA gets bf16, bad names are one clear error."""

import pytest
import torch

from dspark_sgl import dtypes


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, torch.float32),
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),
])
def test_auto_follows_native_bf16_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: flags)
    dtypes.cpu_auto_dtype.cache_clear()
    try:
        assert dtypes.resolve_dtype("auto", "cpu", quiet=True) == expected
    finally:
        dtypes.cpu_auto_dtype.cache_clear()


def test_cuda_auto_is_bf16_and_names_are_checked():
    assert dtypes.resolve_dtype("auto", "cuda", quiet=True) == torch.bfloat16
    assert dtypes.resolve_dtype("bf16") == torch.bfloat16 and dtypes.resolve_dtype("float32") == torch.float32
    with pytest.raises(dtypes.DtypeError, match="must be one of"):
        dtypes.resolve_dtype("fp8")
