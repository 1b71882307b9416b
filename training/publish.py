"""Publishing: push the exported draft into running SGLang servers after an optimizer step (rank 0).

Recipe section `publish` (`PublishConfig`): every `every_steps` optimizer steps the trainer exports the draft to
`<out_dir>/publish/step-N` (with `publish.json` = {"version", "step"}) and asks each server in `url` to load it through
SGLang's own endpoint, `/update_weights_from_disk` (the server must see the folder: same host or a shared
filesystem). With `pause` the server is paused in place around the swap (`/pause_generation` mode `in_place`, then
`/continue_generation`): requests in flight stop between two steps and continue with the new draft, so the update
never waits for them to finish; a trainer killed between the two leaves the pause to the server's lease
(`dspark_pause_lease_s`, dspark_sgl/sglang/weights.py), after which it serves on. The server validates the update
and keeps its old draft if it refuses; the trainer logs the answer (`<out_dir>/publish.jsonl`) and keeps training.
The served version shows in the server's `/server_info` (internal_states[0].dspark_info_record.draft_update).

A server started with SGLang's `--admin-api-key` refuses these calls (401) without the key. `admin_key_env` names the
environment variable that holds it (the key itself never sits in the recipe, and is never logged or journalled); the
trainer sends it as SGLang's `Authorization: Bearer` header.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark_sgl.faults import crash, crash_due
from dspark_sgl.sglang.weights import RELEASE_FILE  # the server reads it; weights.py imports no sglang at load


class PublishConfig(BaseModel):
    """The recipe's `publish` section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    every_steps: int = 0  # optimizer steps between publishes; 0 = never
    url: list[str] = Field(default_factory=list)  # serving engines, http://host:port (one string is one server)
    pause: bool = True  # pause generation in place around each swap
    timeout_s: float = 300.0  # per HTTP call
    keep: int = 2  # published folders kept on disk (a server may still be reading the previous one)
    admin_key_env: str | None = None  # the environment variable holding the servers' --admin-api-key (not the key)

    @field_validator("url", mode="before")
    @classmethod
    def _one_url(cls, v):
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> PublishConfig:
        if self.every_steps < 0:
            raise ValueError(f"publish.every_steps={self.every_steps} must be >= 0 (0 = never)")
        if self.every_steps and not self.url:
            raise ValueError("publish.every_steps is set but publish.url lists no server (http://host:port)")
        bad = [u for u in self.url if not str(u).startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"publish.url entries must be http://host:port, got {bad}")
        if self.keep < 1:
            raise ValueError(f"publish.keep={self.keep} must be >= 1")
        if self.admin_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.admin_key_env):
            raise ValueError("publish.admin_key_env must name an environment variable (e.g. SGLANG_ADMIN_KEY), "
                             "not hold the key")
        return self

    def admin_key(self) -> str | None:
        """The key from the environment variable `admin_key_env` names; None when none is named."""
        if self.admin_key_env is None:
            return None
        key = os.environ.get(self.admin_key_env)
        if not key:
            raise ValueError(f"publish.admin_key_env={self.admin_key_env} but ${self.admin_key_env} is not set")
        return key

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0


def _call(url: str, path: str, payload: dict | None, timeout: float, key: str | None = None) -> tuple[int, dict]:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body or b"{}")
    except json.JSONDecodeError:
        return status, {"text": body.decode(errors="replace")}


def served_draft(url: str, timeout: float = 60.0) -> dict:
    """The server's `draft_update` record (version, step, swaps, refused, last_swap_ms, ...)."""
    _, info = _call(url, "/server_info", None, timeout)
    return info["internal_states"][0]["dspark_info_record"]["draft_update"]


def push(url: str, folder: str | Path, pause: bool = True, timeout: float = 300.0, key: str | None = None) -> dict:
    """Load the draft folder into one server; returns what happened (never raises on a refusal). `key`: the
    server's --admin-api-key, if it has one."""
    t0 = time.perf_counter()
    if pause:
        _call(url, "/pause_generation", {"mode": "in_place"}, timeout, key)
    if crash_due("publish_paused"):  # tests only: the trainer dies here, the server paused (its pause lease ends it)
        crash()
    try:
        status, out = _call(url, "/update_weights_from_disk",
                            {"model_path": str(Path(folder).resolve()), "flush_cache": False}, timeout, key)
    finally:
        if pause:
            _call(url, "/continue_generation", {}, timeout, key)
    message = out.get("message") or out.get("error")  # SGLang: {"error": "Unauthorized"} on a missing key
    return {"url": url, "success": status == 200 and bool(out.get("success")), "status": status,
            "message": message, "wall_ms": (time.perf_counter() - t0) * 1e3}


class Publisher:
    """Rank 0's side: stamp the exported folder with its version, push it to every server, log the answers."""

    def __init__(self, cfg: PublishConfig, out_dir: Path, log=print):
        self.cfg, self.root, self.log = cfg, Path(out_dir) / "publish", log
        self.journal = Path(out_dir) / "publish.jsonl"
        self._key = cfg.admin_key()  # read once at start: a missing variable stops the run before training

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def publish(self, folder: Path, step: int) -> list[dict]:
        version = f"step-{step}"
        (folder / RELEASE_FILE).write_text(json.dumps({"version": version, "step": step}) + "\n")
        results = []
        for url in self.cfg.url:
            try:
                res = push(url, folder, self.cfg.pause, self.cfg.timeout_s, self._key)
            except (OSError, urllib.error.URLError) as e:
                res = {"url": url, "success": False, "message": f"unreachable: {e}", "wall_ms": None}
            res.update(version=version, step=step, folder=str(folder), time=time.time())
            results.append(res)
            self.log(f"publish {version} -> {url}: {'ok' if res['success'] else 'REFUSED'} ({res['message']})")
        with self.journal.open("a") as f:
            for res in results:
                f.write(json.dumps(res) + "\n")
        self._prune()
        return results

    def _prune(self) -> None:
        done = sorted(self.root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in done[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)
