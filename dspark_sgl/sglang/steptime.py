"""Where a decode step's milliseconds go, per phase, as `/server_info` reports them (`step_ms`), and the timings the
full-cost rule learns its cost table from (`on_step`).

The worker marks the end of each phase of a decode step; an "off" step (a plain decode) skips the draft phases. On a
CPU every op has finished when the next mark is taken, so host wall-clock is exact. On CUDA a host timestamp would
measure kernel launches, so each mark records a CUDA event instead, and a step's intervals are read at the start of a
later step, once its last event has completed (`Event.query`, which never waits; under the overlap scheduler that may
be a step or two late): no synchronisation inside a step. Only `info()`, which SGLang calls outside any step, waits for
the steps still in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# decide: speculate or not (the full-cost rule, rank 0's decision under TP); draft: sampling rows, context gather, the
# parallel block pass; rollout: the Markov head's sequential pass and proposals; schedule: verify lengths + the verify
# window; verify: the target forward; accept: the target distribution and the acceptance rule (an off step: the plain
# draw); commit: KV, context and token bookkeeping and the result. An off step has no draft and rollout phases.
PHASES = ("decide", "draft", "rollout", "schedule", "verify", "accept", "commit")
DRAFT_PHASES = ("draft", "rollout")  # what speculating adds to a step; the rest is priced per verify width


def costs_of_step(seconds: dict[str, float]) -> tuple[float, float]:
    """(draft seconds, the rest) of one step's phases: what the full-cost rule prices as T_draft and T_after(w) (an
    off step's whole time is its T_off)."""
    draft = sum(seconds.get(p, 0.0) for p in DRAFT_PHASES)
    return draft, sum(seconds.values()) - draft


class StepTimes:
    """Per-phase sums over speculative steps and over off steps; `on_step(meta, seconds_by_phase)` sees each finished
    step (meta: what `start`/`note` recorded: batch size, speculated, width)."""

    def __init__(self, device, on_step: Callable[[dict, dict[str, float]], None] | None = None) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.on_step = on_step
        self.clear()
        self._marks: list = []
        self._meta: dict = {}
        self._done: list[tuple[dict, list]] = []  # finished steps whose intervals are not summed yet, oldest first

    def clear(self) -> None:
        self.steps = self.off_steps = 0
        self.total_ms = dict.fromkeys(PHASES, 0.0)
        self.off_total_ms = dict.fromkeys(PHASES, 0.0)

    def start(self, **meta) -> None:
        self._collect()
        self._marks = [(None, self._now())]
        self._meta = {"speculate": True, **meta}

    def note(self, **meta) -> None:
        self._meta.update(meta)

    def mark(self, phase: str) -> None:
        assert self._marks, f"phase {phase!r} marked outside a step"
        last = PHASES.index(self._marks[-1][0]) if self._marks[-1][0] is not None else -1
        assert PHASES.index(phase) > last, f"phase {phase!r} out of order"
        self._marks.append((phase, self._now()))
        if phase == PHASES[-1]:
            self._done.append((self._meta, self._marks))
            self._marks = []
            if not self.cuda:
                self._collect()

    def info(self) -> dict:
        self._collect(wait=True)

        def means(total: dict, n: int) -> dict:
            return {p: round(t / max(n, 1), 3) for p, t in total.items()}

        ms, off = means(self.total_ms, self.steps), means(self.off_total_ms, self.off_steps)
        return {"decode_steps_timed": self.steps, "ms_per_step": ms, "total_ms_per_step": round(sum(ms.values()), 3),
                "total_ms": dict(self.total_ms),  # sums, so a client can difference two readings exactly
                "off_steps_timed": self.off_steps, "off_ms_per_step": off,
                "off_total_ms_per_step": round(sum(off.values()), 3), "off_total_ms": dict(self.off_total_ms)}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _collect(self, wait: bool = False) -> None:
        """Sum the finished steps whose events have completed (all of them with wait=True, outside a step)."""
        while self._done:
            meta, marks = self._done[0]
            if self.cuda:
                if not wait and not marks[-1][1].query():
                    return  # still running on the device: read it at a later step
                marks[-1][1].synchronize()  # a no-op once query() said done
            self._done.pop(0)
            seconds = {}
            for (_, a), (phase, b) in zip(marks, marks[1:], strict=False):
                seconds[phase] = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            total = self.total_ms if meta["speculate"] else self.off_total_ms
            for phase, s in seconds.items():
                total[phase] += s * 1e3
            if meta["speculate"]:
                self.steps += 1
            else:
                self.off_steps += 1
            if self.on_step is not None:
                self.on_step(meta, seconds)
