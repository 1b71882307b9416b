"""TEST/BENCHMARK ONLY: let SGLang 0.5.23's own (builtin) DSPARK worker run greedy requests on a CPU.

The builtin is the independent reference our worker must agree with (tests/test_sglang_builtin.py) and a row of
benchmarks/sglang_speed.py. It is never active for users: `dspark serve` loads our worker (plugin `dspark`), and
this module does nothing unless a harness sets DSPARK_SGL_BUILTIN_ON_CPU=1 *and* leaves `dspark` out of
SGLANG_PLUGINS (SGLANG_PLUGINS=dspark_cpu), so the builtin is the DSPARK worker. It is loaded by the `dspark_cpu`
entry point (attention.py), only where SGLang runs on a CPU, in every SGLang process. Three patches, nothing else:

1. `speculative_hook._handle_dspark` (AROUND): SGLang's argument handler refuses any device but CUDA/NPU/XPU before
   resolving the DSPARK arguments. We declare device=cuda for the length of that one call (the handler reads the
   device only for that check and an NPU test) and declare the real device back afterwards.
2. `draft_worker_common.resolve_draft_worker_attention_backend` (REPLACE): the builtin's draft runner accepts only
   GPU attention backends (torch_native is not on its list) and otherwise falls back to flashinfer, which needs CUDA.
   Here it gets torch_native, the CPU server's own backend.
3. `torch.Tensor.record_stream`: the builtin's decode step calls `batch.seq_lens.record_stream(current_stream())`
   (a CUDA caching-allocator hint); a CPU tensor has no such kernel ("unknown parameter type"). For CPU tensors
   the call becomes a no-op (there is one stream on a CPU, so there is nothing to record); others are untouched.

Greedy only: the builtin's sampled acceptance launches a Triton kernel even on its torch fallback, and Triton needs
a GPU (a request with temperature > 0 kills the scheduler: Triton finds no driver), so harnesses send T = 0 only.
Everything else the builtin runs here dispatches to its own torch references for CPU tensors
(sglang/kernels/ops/speculative/dspark/dispatch.py); its draft attention (non-causal, ENCODER_ONLY) goes through
the torch_native backend with our TARGET_VERIFY shim (attention.py).
"""

from __future__ import annotations

import os

import torch

ENV = "DSPARK_SGL_BUILTIN_ON_CPU"
ARGS_TARGET = "sglang.srt.arg_groups.speculative_hook._handle_dspark"
BACKEND_TARGET = "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend"
SOURCE = "dspark_sgl.cpu.builtin (test harness)"
GPU_DEVICES = ("cuda", "npu", "xpu")
# What a harness adds to a CPU server's environment to serve SGLang's builtin DSPARK: our CPU attention shim (which
# loads this module) without our DSPARK plugin, and the switch.
HARNESS_ENV = {"SGLANG_PLUGINS": "dspark_cpu", ENV: "1"}


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def handle_dspark_on_cpu(original, server_args) -> None:
    """AROUND `_handle_dspark`: hide a CPU device from its refusal, and from nothing else."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    device = resolving_view(server_args).device
    if str(device).startswith(GPU_DEVICES):
        return original(server_args)
    declare_resolution(server_args, SOURCE, device="cuda")
    try:
        original(server_args)
    finally:
        declare_resolution(server_args, SOURCE, device=device)


def draft_attention_on_cpu(*, algo_label=None) -> str:
    """`resolve_draft_worker_attention_backend` on a CPU: the draft attends with torch_native."""
    return "torch_native"


_record_stream = torch.Tensor.record_stream


def record_stream(self: torch.Tensor, stream) -> None:
    """`Tensor.record_stream`, a no-op for CPU tensors (one stream: nothing can reuse the memory early)."""
    if self.device.type != "cpu":
        _record_stream(self, stream)


def load() -> None:
    if not enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ARGS_TARGET, handle_dspark_on_cpu, HookType.AROUND)
    HookRegistry.register(BACKEND_TARGET, draft_attention_on_cpu, HookType.REPLACE)
    torch.Tensor.record_stream = record_stream
