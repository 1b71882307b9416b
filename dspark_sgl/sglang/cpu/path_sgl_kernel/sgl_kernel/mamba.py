"""`sgl_kernel.mamba` for a CPU: the conv update SGLang's KDA backend imports on CPU (dspark_sgl/sglang/cpu/kda.py);
any other name (e.g. the GDN ops gdn_triton imports beside it) is a stub that raises on call."""

import torch

from dspark_sgl.sglang.cpu.kda import causal_conv1d_update as causal_conv1d_update_cpu  # noqa: F401
from sgl_kernel import _Missing

# The GDN modules read these ops at import time on CPU (the hybrid backend registry imports them for every hybrid
# model); GDN itself is not exercised, so each op only says so when called.
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def _missing_op(name: str):
    def op(x):
        raise NotImplementedError(f"torch.ops.sgl_kernel.{name} is not in the CPU stand-in")

    _LIB.define(f"{name}(Tensor x) -> Tensor")
    _LIB.impl(name, op, "CompositeExplicitAutograd")


for _name in ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu"):
    _missing_op(_name)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"mamba.{name}")
