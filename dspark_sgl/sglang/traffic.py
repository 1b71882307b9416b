"""Opt-in recording of served traffic as on-policy training data (the outputs are the target's own).

Start a DSPARK server with `--json-model-override-args '{"dspark_traffic": {"dir": "DIR", ...}}'`; finished requests
(a `sample_rate` fraction, chosen by a seeded draw) are appended to `DIR/samples.jsonl` as the trainer's cached-sample
lines `{"id", "input_ids", "loss_mask"}` (prompt tokens unsupervised, generated tokens supervised). A record that
would take the file past `max_bytes` first rotates it (`samples.jsonl` -> `.1` -> `.2` ..., the oldest beyond `keep`
deleted), so disk use stays under (keep + 1) * max_bytes and every file holds whole records only; `keep: 0` instead
stops recording at the cap (nothing recorded is ever deleted). Ids keep rising across files and restarts. The trainer
consumes the folder as is: `data.cache_dir=DIR` (the rotated set, oldest first, via `traffic_files`; nothing is
re-tokenised). `include_pii` (off by default) adds what identifies a request beyond its tokens: the request
id and the finish time. Aborted requests and ones with fewer than `min_generated` new tokens are skipped. The file holds
users' prompts, so it is readable by its owner only (mode 0600, also when it existed before).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_sgl.faults import crash, crash_due

OVERRIDE_KEY = "dspark_traffic"
SAMPLES_FILE = "samples.jsonl"
FILE_MODE = 0o600  # users' prompts: the owner only


def _owner_only(path, flags: int) -> int:
    return os.open(path, flags, FILE_MODE)  # a new file is created 0600 (the umask only removes bits)


def _rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _drop_torn_tail(path: Path) -> None:
    """A server killed mid-write leaves a partial last line; appending after it would glue the next record to it."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def traffic_files(path: str | Path) -> list[Path]:
    """The existing files of a (possibly rotated) recording, oldest first: `path.K` ... `path.1`, `path`.

    The trainer reads them in this order; record ids rise through it, so each record is read once, in order."""
    path = Path(path)
    old = [p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()]
    return sorted(old, key=lambda p: -int(p.suffix[1:])) + ([path] if path.exists() else [])


@dataclass
class TrafficConfig:
    dir: str
    sample_rate: float = 1.0  # fraction of finished requests recorded
    max_bytes: int = 256 << 20  # one file's cap: past it the file rotates (or, with keep=0, recording stops)
    keep: int = 3  # rotated files kept (samples.jsonl.1 newest ... .keep oldest)
    include_pii: bool = False  # request id and finish time; off: token ids only
    min_generated: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.sample_rate) <= 1.0:
            raise ValueError(f"{OVERRIDE_KEY}.sample_rate={self.sample_rate} must be in [0, 1]")
        if int(self.max_bytes) <= 0:
            raise ValueError(f"{OVERRIDE_KEY}.max_bytes={self.max_bytes} must be > 0")
        if int(self.keep) < 0:
            raise ValueError(f"{OVERRIDE_KEY}.keep={self.keep} must be >= 0")
        if int(self.min_generated) < 1:
            raise ValueError(f"{OVERRIDE_KEY}.min_generated={self.min_generated} must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict) -> TrafficConfig:
        if not isinstance(raw, dict) or "dir" not in raw:
            raise ValueError(f"{OVERRIDE_KEY} must be a mapping with at least 'dir', got {raw!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown {OVERRIDE_KEY} key(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)


class TrafficRecorder:
    def __init__(self, cfg: TrafficConfig):
        self.cfg = cfg
        self.path = Path(cfg.dir) / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_torn_tail(self.path)
        self.bytes = self.path.stat().st_size if self.path.exists() else 0
        for f in traffic_files(self.path):
            os.chmod(f, FILE_MODE)  # files from before may be wider
        self.next_id = self._last_id() + 1
        self.rng = random.Random(cfg.seed)
        self.live: dict[int, object] = {}  # id(req) -> req, until it finishes
        self.recorded = self.skipped = 0
        self.full = cfg.keep == 0 and self.bytes >= cfg.max_bytes

    @classmethod
    def from_server_args(cls) -> TrafficRecorder | None:
        from dspark_sgl.sglang.args import override_arg

        raw = override_arg(OVERRIDE_KEY)
        return None if raw is None else cls(TrafficConfig.from_dict(raw))

    def _last_id(self) -> int:
        """The highest id recorded so far: the newest file that holds one (ids rise through the rotated set)."""
        for f in reversed(traffic_files(self.path)):
            last = -1
            for line in f.read_text().splitlines():
                try:
                    last = max(last, int(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line
            if last >= 0:
                return last
        return -1

    def _rotate(self) -> None:
        """samples.jsonl -> .1 -> .2 ...; the file at .keep is replaced (deleted). os.replace keeps the 0600 mode."""
        for n in range(self.cfg.keep, 0, -1):
            src = self.path if n == 1 else _rotated(self.path, n - 1)
            if src.exists():
                os.replace(src, _rotated(self.path, n))
        self.bytes = 0

    def observe(self, reqs) -> None:
        """Remember this step's requests; those that finished since the last step are recorded."""
        self.sweep()
        if not self.full:
            for r in reqs or ():
                self.live.setdefault(id(r), r)

    def sweep(self) -> None:
        for key, r in list(self.live.items()):
            if r.finished():
                self.live.pop(key, None)
                self._record(r)

    def _record(self, req) -> None:
        reason = type(getattr(req, "finished_reason", None)).__name__
        out = list(req.output_ids)
        if "ABORT" in reason.upper() or len(out) < self.cfg.min_generated or self.full:
            self.skipped += 1
            return
        if self.rng.random() >= self.cfg.sample_rate:
            self.skipped += 1
            return
        prompt = list(req.origin_input_ids)
        rec = {"id": self.next_id, "input_ids": prompt + out, "loss_mask": [0] * len(prompt) + [1] * len(out)}
        if self.cfg.include_pii:
            rec.update(rid=str(req.rid), finished_at=time.time())
        line = json.dumps(rec) + "\n"
        if self.bytes + len(line) > self.cfg.max_bytes:
            if self.cfg.keep == 0:  # stop at the cap: nothing recorded is ever deleted
                self.full = True
                self.live.clear()
                self.skipped += 1
                return
            if len(line) > self.cfg.max_bytes:  # no file could hold it
                self.skipped += 1
                return
            self._rotate()
        with open(self.path, "a", opener=_owner_only) as f:
            if crash_due("traffic_write", str(req.rid)):  # tests only: the server dies with half a record written
                f.write(line[: len(line) // 2])
                f.flush()
                crash()
            f.write(line)
        self.bytes += len(line)
        self.next_id += 1
        self.recorded += 1

    def info(self) -> dict:
        return {"path": str(self.path), "recorded": self.recorded, "skipped": self.skipped, "bytes": self.bytes,
                "full": self.full, "sample_rate": self.cfg.sample_rate, "keep": self.cfg.keep,
                "live": len(self.live)}  # requests seen and not finished: 0 at idle, or some leaked
