"""oneDNN-packed fp32 linears for the DECODE and TARGET_VERIFY forwards of SGLang on a CPU (issue #22).

SGLang's unquantized linear on a CPU without AMX is `F.linear`, whose fp32 GEMM for a handful of rows (a verify window,
a small decode batch) costs nearly as much per row as for one: measured on a 2-core AMD EPYC, 4 rows of a 576x1536
layer took 1.9x one row's time. oneDNN's linear over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what Inductor's CPU freezing uses) takes 1.2x. So
while dspark_cpu's attention backend (attention.py) runs a DECODE or TARGET_VERIFY forward, an fp32 linear over at
least MIN_ROWS rows (the lm_head included) goes through the packed weight; prefill, extend, one-row steps and every
other dtype keep SGLang's own path. The packed copies (one more copy of the linear weights in memory) are made when
the attention backend starts (`pack_model`), after the weights are loaded and before the first request: made on
first use instead, they cost the server's first multi-row step ~0.4-0.8 s (stop 51-52 on a 2-core EPYC: a 872 ms
step against a 107 ms median). A layer packed at start is repacked when its weight changes (a weight update bumps
its version), and one it missed is packed on first use. DSPARK_SGL_PACKED_LINEAR=0 turns it off.
"""

from __future__ import annotations

import os

import torch

ENV = "DSPARK_SGL_PACKED_LINEAR"
TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
MIN_ROWS = 2  # benchmarks/results/sglang_verify_cost.json: one row gains nothing, two already do


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and torch.backends.mkldnn.is_available()


def packed_weight(layer) -> torch.Tensor:
    """layer.weight in oneDNN's blocked layout, cached on the layer until the weight's storage or version changes."""
    w = layer.weight
    key = (w.data_ptr(), w._version)
    cached = getattr(layer, "_dspark_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), MIN_ROWS))
        layer._dspark_packed = cached
    return cached[1]


def _packable(weight) -> bool:
    """What `wants_packed` asks of a weight: a plain fp32 2-D CPU tensor (not a quantized or sharded wrapper)."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.dim() == 2)


def pack_model(model: torch.nn.Module) -> None:
    """Pack now every layer a DECODE or TARGET_VERIFY forward would pack on first use: the linears whose quant method
    is SGLang's unquantized one and the model's lm_head (when `apply_around` / `lm_head_around` would take them)."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)]
    if head is not None and not hasattr(head, "set_lora"):
        layers.append(head)
    for layer in dict.fromkeys(layers):  # a tied lm_head may also be listed as a linear: once
        if _packable(getattr(layer, "weight", None)):
            packed_weight(layer)


def packed_linear(x: torch.Tensor, layer, bias=None) -> torch.Tensor:
    """x @ layer.weight.T + bias through the packed weight (any leading shape)."""
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed_weight(layer), bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def wants_packed(layer, x: torch.Tensor) -> bool:
    """An fp32 CPU linear of >= MIN_ROWS rows inside a forward whose attention backend asks for packed linears."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

    return (_packable(getattr(layer, "weight", None)) and x.device.type == "cpu" and x.dtype == torch.float32
            and x.numel() >= MIN_ROWS * x.shape[-1]
            and has_forward_context() and getattr(get_attn_backend(), "packed_linear_now", False))


def apply_around(original, method, layer, x, bias=None):
    """HookType.AROUND on UnquantizedLinearMethod.apply."""
    if wants_packed(layer, x):
        return packed_linear(x, layer, bias)
    return original(method, layer, x, bias)


def lm_head_around(original, processor, hidden_states, lm_head, embedding_bias=None, **kwargs):
    """HookType.AROUND on LogitsProcessor._compute_lm_head: a verify computes logits for every window row, so the
    (tied) lm_head is a linear of bs*w rows too. A LoRA, quantized or biased lm_head keeps SGLang's path."""
    plain = embedding_bias is None and not hasattr(lm_head, "set_lora")
    if plain and not getattr(processor, "use_fp32_lm_head", False) and wants_packed(lm_head, hidden_states):
        return packed_linear(hidden_states, lm_head)
    return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)


def register(HookRegistry, HookType) -> None:  # noqa: N803 - SGLang's class names, passed in
    if enabled():
        HookRegistry.register(TARGET, apply_around, HookType.AROUND)
        HookRegistry.register(LM_HEAD, lm_head_around, HookType.AROUND)
