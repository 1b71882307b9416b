"""Dtype names, and `auto`: bf16 only where the hardware multiplies bf16 natively.

On CPUs without AMX / AVX512-BF16 a bf16 matmul is emulated: measured 17x slower than fp32 on an AVX2 EPYC
(64x576 @ 576x576, one thread), and 2-3x faster than fp32 with AMX. So `auto` is: CUDA -> bf16; a CPU -> bf16 when its
flags name a native bf16 unit, else fp32. It reads the flags and does not time a matmul: a timing taken on a busy box
flipped between two processes started together (1.50 vs 0.26 ms in one, 0.24 vs 0.25 in the other), and every rank
and server of one job must agree. The choice is printed once per process. Master weights and optimizer state stay
fp32 whatever this says (the trainer's rule).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


class DtypeError(ValueError):
    """A dtype name that is not one of DTYPE_NAMES (or their short forms)."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """(dtype, why) for this CPU, from its flags."""
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags())
    if not native:
        return torch.float32, f"cpu {torch.backends.cpu.get_cpu_capability()} without {'/'.join(NATIVE_BF16_FLAGS)}"
    return torch.bfloat16, f"cpu has {'+'.join(native)}"


def decode_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype for batched decoding (the recipe's regeneration): a decode step is a few rows against all the
    weights, where only AMX makes bf16 pay. Measured on a 2-core AVX512-BF16 EPYC, HF SmolLM2-135M, 2 threads:
    a 64-row decode step took 405 ms in fp32 and 553 ms in bf16 (a 16-row answer batch: 65 vs 48 tok/s), while
    training-shaped matmuls there run 2-3x faster in bf16 (hence `auto` above stays bf16 for them)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if "amx_bf16" in cpu_flags() else torch.float32


_printed: set[str] = set()


def resolve_dtype(name: str, device: str | torch.device = "cpu", *, what: str = "dtype", quiet: bool = False
                  ) -> torch.dtype:
    """torch dtype for a name; `auto` by device capability (printed once per `what`)."""
    if name not in DTYPES and name != "auto":
        raise DtypeError(f"{what} must be one of {list(DTYPE_NAMES)}, got {name!r}")
    if name != "auto":
        return DTYPES[name]
    if torch.device(device).type == "cuda":
        dtype, why = torch.bfloat16, "cuda"
    else:
        dtype, why = cpu_auto_dtype()
    if not quiet and what not in _printed:
        _printed.add(what)
        print(f"[dspark] {what} auto -> {dtype_name(dtype)} ({why})", file=sys.stderr, flush=True)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
