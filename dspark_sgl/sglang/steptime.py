"""Where a decode step's milliseconds go, per phase, as `/server_info` reports them (`step_ms`).

The worker marks the end of each phase of a decode step. On a CPU every op has finished when the next mark is taken,
so host wall-clock is exact. On CUDA a host timestamp would measure kernel launches, so each mark records a CUDA event
instead, and a step's intervals are read at the start of a later step, once its last event has completed
(`Event.query`, which never waits; under the overlap scheduler that may be a step or two late): no synchronisation
inside a step. Only `info()`, which SGLang calls outside any step, waits for the steps still in flight.
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
        self._done: list[list] = []  # finished steps whose intervals are not summed yet, oldest first

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
            self._done.append(self._marks)
            self._marks = []
            if not self.cuda:
                self._collect()

    def info(self) -> dict:
        self._collect(wait=True)
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

    def _collect(self, wait: bool = False) -> None:
        """Sum the finished steps whose events have completed (all of them with wait=True, outside a step)."""
        while self._done:
            marks = self._done[0]
            if self.cuda:
                if not wait and not marks[-1].query():
                    return  # still running on the device: read it at a later step
                marks[-1].synchronize()  # a no-op once query() said done
            self._done.pop(0)
            for phase, (a, b) in zip(PHASES, pairwise(marks), strict=True):
                self.total_ms[phase] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            self.steps += 1
