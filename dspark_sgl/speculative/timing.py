"""Where a draft step's time goes: backbone, lm_head, Markov rollout, confidence head (`dspark eval`, `generate`).

Off by default: on CUDA every lap synchronises the device, which a served step should not pay.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

PHASES = ("backbone", "lm_head", "markov", "confidence")


class StepTimer:
    """Accumulates wall seconds per phase; `lap(phase, t)` closes the phase that ends when tensor t is ready."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._t = time.perf_counter()

    def start(self, t: Tensor | None = None) -> None:
        self._t = self._now(t)

    def lap(self, phase: str, t: Tensor | None = None) -> None:
        now = self._now(t)
        self.seconds[phase] += now - self._t
        self._t = now

    @staticmethod
    def _now(t: Tensor | None) -> float:
        if t is not None and t.is_cuda:
            torch.cuda.synchronize(t.device)
        return time.perf_counter()
