"""Steps-per-second table: how fast the target verifies a batch of B tokens.

The confidence scheduler trades expected accepted tokens against step rate, so it needs SPS(B) for every
batch verify-token count B it may try. We measure a few B once (at start-up or with `dspark profile-sps`),
smooth the curve to be non-increasing (more tokens never makes a step faster; measured bumps are noise or
graph-bucket artefacts that would make the scheduler chase them) and look values up by floor.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


def isotonic_non_increasing(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Least-squares non-increasing fit (pool adjacent violators); unlike a running minimum, one low
    outlier does not drag the whole tail down."""
    w = [1.0] * len(values) if weights is None else [float(x) for x in weights]
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, wi in zip(values, w, strict=True):
        blocks.append([float(v), wi, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(n)]


@dataclass
class SpsTable:
    """Measured steps/s at increasing batch verify-token counts; lookups floor to the nearest measured
    count at or below B and clamp outside the measured range."""

    tokens: list[int]
    steps_per_s: list[float]
    meta: dict = field(default_factory=dict)
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.tokens]
        self.steps_per_s = [float(s) for s in self.steps_per_s]
        if not self.tokens or len(self.tokens) != len(self.steps_per_s):
            raise ValueError(
                f"SpsTable needs equal, non-empty tokens and steps_per_s "
                f"(got {len(self.tokens)} and {len(self.steps_per_s)})"
            )
        if self.tokens[0] < 1 or any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"SpsTable tokens must be positive and strictly increasing, got {self.tokens}")
        if not all(math.isfinite(s) and s > 0 for s in self.steps_per_s):
            raise ValueError(f"SpsTable steps_per_s must be finite and > 0, got {self.steps_per_s}")

    def smoothed(self) -> SpsTable:
        """The same table made non-increasing in tokens (isotonic fit); the raw values go to meta."""
        meta = {**self.meta, "raw_steps_per_s": list(self.steps_per_s)}
        return SpsTable(self.tokens, isotonic_non_increasing(self.steps_per_s), meta)

    def is_monotone(self) -> bool:
        return all(b <= a for a, b in zip(self.steps_per_s, self.steps_per_s[1:], strict=False))

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """SPS at each entry of an integer tensor of token counts, on its device, float64, no host sync."""
        keys, vals = self._tensors(tokens.device)
        idx = torch.searchsorted(keys, tokens.to(torch.long), right=True) - 1
        return vals[idx.clamp(min=0)]

    def counts(self, device: torch.device | str) -> torch.Tensor:
        """The measured token counts as a long tensor on device (cached: no copy per scheduler step)."""
        return self._tensors(torch.device(device))[0]

    def __call__(self, tokens: int) -> float:
        """SPS at one token count (host side, for reports and benchmarks)."""
        return float(self.lookup(torch.tensor([tokens]))[0])

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Cached per device so a scheduler call on GPU does not copy (and sync on) the table each step.
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (
                torch.tensor(self.tokens, dtype=torch.long, device=device),
                torch.tensor(self.steps_per_s, dtype=torch.float64, device=device),
            )
        return self._on_device[key]

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "steps_per_s": self.steps_per_s, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> SpsTable:
        if not isinstance(d, dict) or "tokens" not in d or "steps_per_s" not in d:
            raise ValueError("SPS table JSON must be an object with 'tokens' and 'steps_per_s' lists")
        return cls(d["tokens"], d["steps_per_s"], d.get("meta", {}))

    def save(self, path: str | Path) -> None:
        """Written whole or not at all (a temporary file renamed over it): a server reading the file, or killed
        while writing it, never sees half a table."""
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, file)

    @classmethod
    def load(cls, path: str | Path) -> SpsTable:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"SPS table not found: {file}")
        return cls.from_dict(json.loads(file.read_text()))


def default_token_counts(max_tokens: int) -> list[int]:
    """A short start-up schedule: 1..4, then powers of two and their midpoints, then max_tokens
    (about 2·log2(max) forward passes)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    counts = {c for c in (1, 2, 3, 4, max_tokens) if c <= max_tokens}
    p = 4
    while p <= max_tokens:
        counts.update(c for c in (p, p + p // 2) if c <= max_tokens)
        p *= 2
    return sorted(counts)


def profile_sps(
    step_fn: Callable[[int], object],
    token_counts: Sequence[int],
    warmup: int = 2,
    repeats: int = 5,
    sync: Callable[[], object] | None = None,
    smooth: bool = True,
) -> SpsTable:
    """Time step_fn(n) (one target verify forward over n batch tokens) for each n; steps/s is
    1 / median seconds. Pass sync (e.g. torch.cuda.synchronize) when step_fn returns before the device
    finishes."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    counts = sorted({int(n) for n in token_counts})
    if not counts or counts[0] < 1:
        raise ValueError(f"token_counts must be non-empty positive integers, got {list(token_counts)}")
    sync = sync or (lambda: None)
    rates = []
    for n in counts:
        for _ in range(warmup):
            step_fn(n)
        sync()
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step_fn(n)
            sync()
            seconds.append(time.perf_counter() - t0)
        rates.append(1.0 / max(statistics.median(seconds), 1e-9))
    table = SpsTable(counts, rates, {"warmup": warmup, "repeats": repeats})
    return table.smoothed() if smooth else table
