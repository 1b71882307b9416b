"""Progress that reads the same in a terminal and in a log file: `what done/total, s/item, ETA`.

A rich bar redraws in place and says nothing when stdout is a file (`make demo > log`), so long phases
(regeneration, training, evaluation) report through this instead: a line every `every_s` seconds, and at the end.
"""

from __future__ import annotations

import sys
import time


def fmt_duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressLine:
    def __init__(self, what: str, total: int, every_s: float = 30.0, start: int = 0, stream=None):
        self.what, self.total, self.every_s, self.done = what, total, every_s, start
        self.start_done, self.stream = start, stream or sys.stdout
        self.t0 = self.last = time.monotonic()

    def eta_s(self) -> float:
        rate = (time.monotonic() - self.t0) / max(1, self.done - self.start_done)
        return rate * (self.total - self.done)

    def line(self, extra: str = "") -> str:
        made = self.done - self.start_done
        per = (time.monotonic() - self.t0) / made if made else float("nan")
        elapsed, eta = fmt_duration(time.monotonic() - self.t0), fmt_duration(self.eta_s())
        text = f"{self.what} {self.done}/{self.total} {per:.2f} s/it elapsed {elapsed} ETA {eta}"
        return text + (f" {extra}" if extra else "")

    def update(self, n: int = 1, extra: str = "", force: bool = False) -> str | None:
        """Advance; print (and return) a line when `every_s` has passed, at the end, or when forced."""
        self.done += n
        now = time.monotonic()
        if force or self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            text = self.line(extra)
            print(text, file=self.stream, flush=True)
            return text
        return None
