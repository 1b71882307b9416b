"""Where a reference-engine step's time goes (`dspark eval`, `generate`, benchmarks/spec_speed.py).

PHASES split the draft's own work (backbone, lm_head, Markov rollout, confidence head); off by default, because on
CUDA every lap synchronises the device, which a served step should not pay. STEP_PHASES split a whole decode step
(plain or DSpark): draft backbone, rollout (+ schedule), the target's verify forward, acceptance, commit (target KV
and draft context bookkeeping), and the rest (emitting tokens, per-request stats, finished rows leaving the batch).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

PHASES = ("backbone", "lm_head", "markov", "confidence")
STEP_PHASES = ("draft", "rollout", "verify", "accept", "commit", "other")


class StepTimer:
    """Accumulates wall seconds per phase; `lap(phase, t)` closes the phase that ends when tensor t is ready."""

    def __init__(self, phases: tuple[str, ...] = PHASES) -> None:
        self.seconds = dict.fromkeys(phases, 0.0)
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
