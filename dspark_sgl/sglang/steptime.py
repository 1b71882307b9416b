"""Where a decode step's milliseconds go, per phase, as `/server_info` reports them (`step_ms`).

The worker marks the end of each phase of a decode step. On a CPU every op has finished when the next mark is taken,
so host wall-clock is exact. On CUDA a host timestamp would measure kernel launches, so each mark records a CUDA event
instead, and a step's intervals are read at the start of the next step (by then the scheduler has copied that step's
tokens to the host, so its events are complete): no extra synchronisation inside a step.
"""

from __future__ import annotations

import time
from itertools import pairwise

import torch

# draft: sampling rows, context gather, the parallel block pass; rollout: the Markov head's sequential pass and
# proposals; probe: the live SPS measurement (first step of each batch-size bucket only); schedule: verify lengths +
# the verify window; verify: the target forward; accept: the target distribution and the acceptance rule; commit: KV,
# context and token bookkeeping and the result.
PHASES = ("draft", "rollout", "probe", "schedule", "verify", "accept", "commit")


class StepTimes:
    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.clear()
        self._marks: list = []
        self._done: list = []

    def clear(self) -> None:
        self.steps = 0
        self.total_ms = dict.fromkeys(PHASES, 0.0)

    def start(self) -> None:
        self._collect()
        self._marks = [self._now()]

    def mark(self, phase: str) -> None:
        assert phase == PHASES[len(self._marks) - 1], f"phase {phase!r} out of order"
        self._marks.append(self._now())
        if len(self._marks) == len(PHASES) + 1:
            self._done, self._marks = self._marks, []
            if not self.cuda:
                self._collect()

    def info(self) -> dict:
        self._collect()
        n = max(self.steps, 1)
        ms = {p: round(t / n, 3) for p, t in self.total_ms.items()}
        return {"decode_steps_timed": self.steps, "ms_per_step": ms, "total_ms_per_step": round(sum(ms.values()), 3),
                "total_ms": dict(self.total_ms)}  # sums, so a client can difference two readings exactly

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _collect(self) -> None:
        if not self._done:
            return
        marks, self._done = self._done, []
        if self.cuda:
            marks[-1].synchronize()
        for phase, (a, b) in zip(PHASES, pairwise(marks), strict=True):
            self.total_ms[phase] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        self.steps += 1
