"""A stock SGLang engine as the trainer's capture engine: in-process `sglang.Engine`, or a running server's URL.

The hooks that make SGLang return aux + post-norm rows live in `capture.py`; this file only starts the engine with
the settings they need and turns its replies into padded tensors. Importing it does not import sglang.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch

from dspark_sgl.sglang.cpu import SGLANG_CPU_ARGS  # one definition with `dspark serve`'s CPU flags (re-exported)


class EngineError(RuntimeError):
    """The target engine cannot serve the trainer (missing SGLang, bad settings, bad output)."""


def check_sglang_importable() -> None:
    """The sglang engine needs stock SGLang in this Python (the capture hooks ship in dspark_sgl.sglang)."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineError(f"engine.kind=sglang needs SGLang 0.5.23 importable by {sys.executable} "
                          "(pip install 'dspark-sgl[sglang]'), or use engine.kind=hf")


def capture_engine_args(model_path: str, dtype: str, layer_ids: list[int], device: torch.device, tp_size: int = 1,
                        seed: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """sglang.Engine keyword arguments of a capture engine (`extra`, the user's own settings, last)."""
    from dspark_sgl.sglang.capture import engine_kwargs

    extra = extra or {}
    capture = engine_kwargs(layer_ids)
    clash = sorted(set(extra) & set(capture))
    if clash:
        raise EngineError(f"engine.sglang_args may not set {clash}: the capture engine needs them as they are")
    args: dict[str, Any] = dict(model_path=model_path, dtype=dtype, tp_size=tp_size, random_seed=seed)
    if device.type == "cpu":
        args.update(SGLANG_CPU_ARGS)
    else:
        args["base_gpu_id"] = device.index or 0
    return {**args, **capture, **extra}


class SGLangCapture:
    """capture(ids, attn) over SGLang: an in-process sglang.Engine built from `engine_args`, or a server at `url`.

    Each row of the batch is sent unpadded (its attention-mask length); replies are padded back to [B, T, ·]."""

    def __init__(self, num_aux: int, hidden: int, engine_args: dict[str, Any] | None = None, url: str | None = None,
                 dtype: torch.dtype | None = None):
        self.num_aux, self.hidden = num_aux, hidden
        self.row_width = (num_aux + 1) * hidden  # rows of the tensor data plane: [aux | post-norm last]
        self.dtype = dtype or getattr(torch, (engine_args or {}).get("dtype") or "float32")  # the model's dtype
        self.engine = None
        if url:
            self.handle = url
            return
        check_sglang_importable()
        if engine_args.get("device") == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's own switch for its CPU code paths
        import sglang

        self.engine = self.handle = sglang.Engine(**engine_args)

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor):
        from dspark_sgl.sglang.capture import capture
        from dspark_sgl.targets.hf import TargetOutput

        lengths = attn.sum(1).tolist()
        got = capture(self.handle, [ids[b, :n].tolist() for b, n in enumerate(lengths)], self.num_aux, self.hidden)
        B, T = ids.shape
        aux = torch.zeros(B, T, self.num_aux * self.hidden)
        last = torch.zeros(B, T, self.hidden)
        for b, (n, c) in enumerate(zip(lengths, got, strict=True)):
            aux[b, :n], last[b, :n] = c.aux, c.last
        return TargetOutput(aux=aux, last_hidden=last, logits=None)

    def capture_to(self, token_id_lists: list[list[int]], routes) -> None:
        """Tagged capture: the engine's writer rank ships each sample's rows to its `transport.Route`."""
        from dspark_sgl.sglang.capture import capture_to

        capture_to(self.handle, token_id_lists, [r.rid for r in routes])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
