"""Dtype names, and `auto`: bf16 only where the hardware multiplies bf16 natively.

On CPUs without AMX / AVX512-BF16 a bf16 matmul is emulated: measured 17x slower than fp32 on an AVX2 EPYC
(64x576 @ 576x576, one thread). So `auto` never guesses: CUDA -> bf16; a CPU -> bf16 only when its flags name a
native bf16 unit AND one timed matmul confirms bf16 is faster there, else fp32. The choice is made once per process
and printed once. Master weights and optimizer state stay fp32 whatever this says (the trainer's rule).
"""

from __future__ import annotations

import functools
import sys
import time
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


def _matmul_ms(dtype: torch.dtype, reps: int = 3) -> float:
    a, b = torch.randn(64, 576, dtype=dtype), torch.randn(576, 576, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return (time.perf_counter() - t) / reps * 1e3


@functools.cache
def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """(dtype, why) for this CPU; measured once per process."""
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags())
    if not native:
        return torch.float32, f"cpu {torch.backends.cpu.get_cpu_capability()} without {'/'.join(NATIVE_BF16_FLAGS)}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = _matmul_ms(torch.float32), _matmul_ms(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    why = f"cpu {'+'.join(native)}: bf16 matmul {bf16:.2f} ms vs fp32 {fp32:.2f} ms"
    return (torch.bfloat16 if bf16 < fp32 else torch.float32), why


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
