"""Opt-in recording of served traffic as on-policy training data (the outputs are the target's own).

Start a DSPARK server with `--json-model-override-args '{"dspark_traffic": {"dir": "DIR", ...}}'`; finished requests
(a `sample_rate` fraction, chosen by a seeded draw) are appended to `DIR/samples.jsonl` as the trainer's cached-sample
lines `{"id", "input_ids", "loss_mask"}` (prompt tokens unsupervised, generated tokens supervised) until the file
reaches `max_bytes`. The trainer consumes the folder as is: `data.cache_dir=DIR` (its `samples.jsonl` is read and
nothing is re-tokenised). `include_pii` (off by default) adds what identifies a request beyond its tokens: the request
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

OVERRIDE_KEY = "dspark_traffic"
SAMPLES_FILE = "samples.jsonl"
FILE_MODE = 0o600  # users' prompts: the owner only


def _owner_only(path, flags: int) -> int:
    return os.open(path, flags, FILE_MODE)  # a new file is created 0600 (the umask only removes bits)


@dataclass
class TrafficConfig:
    dir: str
    sample_rate: float = 1.0  # fraction of finished requests recorded
    max_bytes: int = 256 << 20  # the file stops growing here
    include_pii: bool = False  # request id and finish time; off: token ids only
    min_generated: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.sample_rate) <= 1.0:
            raise ValueError(f"{OVERRIDE_KEY}.sample_rate={self.sample_rate} must be in [0, 1]")
        if int(self.max_bytes) <= 0:
            raise ValueError(f"{OVERRIDE_KEY}.max_bytes={self.max_bytes} must be > 0")
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
        self.bytes = 0
        if self.path.exists():
            os.chmod(self.path, FILE_MODE)  # a file from before may be wider
            self.bytes = self.path.stat().st_size
        self.next_id = self._last_id() + 1
        self.rng = random.Random(cfg.seed)
        self.live: dict[int, object] = {}  # id(req) -> req, until it finishes
        self.recorded = self.skipped = 0
        self.full = self.bytes >= cfg.max_bytes

    @classmethod
    def from_server_args(cls) -> TrafficRecorder | None:
        from sglang.srt.runtime_context import get_model

        raw = json.loads(get_model().json_model_override_args or "{}").get(OVERRIDE_KEY)
        return None if raw is None else cls(TrafficConfig.from_dict(raw))

    def _last_id(self) -> int:
        last = -1
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    last = max(last, int(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line
        return last

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
            self.full = True
            self.live.clear()
            self.skipped += 1
            return
        with open(self.path, "a", opener=_owner_only) as f:
            f.write(line)
        self.bytes += len(line)
        self.next_id += 1
        self.recorded += 1

    def info(self) -> dict:
        return {"path": str(self.path), "recorded": self.recorded, "skipped": self.skipped, "bytes": self.bytes,
                "full": self.full, "sample_rate": self.cfg.sample_rate}
