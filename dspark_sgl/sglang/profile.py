"""`dspark profile-costs`: the full-cost rule's step costs measured before serving, into the per-machine cache.

The rule (speculative/scheduler.py) prices every step from a cost table: per batch bucket, an off step, the draft, and
verify + accept + commit at each width. A server learns that table from its own steps, but a bucket it has never
seen starts cold: its first steps speculate and go off by turns (3 + 3) before the rule decides, while real requests
wait. This command runs those steps before any user does: the same `dspark serve` command line (same target,
flags and machine, so the same cache key: planning.engine_facts), a server on a loopback port, then for each batch
bucket B `repeats` rounds of B concurrent requests in each of two arms, interleaved (the order alternates by round):
  - off:  `/set_internal_state dspark_force_budget_frac` = 1/(γ+1): every step an off step (T_off, T_after(1));
  - spec: = (γ + 0.5)/(γ+1): every step drafts and verifies at width <= γ+1 (T_draft, T_after(w) at the widths the
          rule picks; linear between measured widths);
then `/server_info` (which writes the table) and the server is stopped. Each cell is the median of its last 9 steps
(CostTable), so >= 5 rounds of >= `new_tokens` steps per arm and bucket fill it from this profile alone.

The prompts are random token ids (fixed seed; costs depend on lengths, not on the text), `ignore_eos`, so every
request runs exactly `new_tokens` steps. A later `dspark serve` with the same flags loads the table at start-up
("step costs: buckets [...] loaded from ...") and corrects it online from its own steps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dspark_sgl.sglang.client import post_json
from dspark_sgl.speculative.scheduler import batch_bucket, buckets_up_to

PROMPT_TOKENS = 64


@dataclass(frozen=True)
class ProfilePlan:
    batch_sizes: tuple[int, ...] = buckets_up_to(16)  # every bucket: those it skipped served on a guess (stop 49)
    repeats: int = 5
    new_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1 or self.new_tokens < 2:
            raise ValueError(f"need repeats >= 1 and new_tokens >= 2, got {self.repeats}, {self.new_tokens}")


class ProfileServer:
    """The `dspark serve` command's SGLang process, in its own session (stopped whole on exit or Ctrl-C)."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float = 900.0):
        self.cmd, self.env, self.url, self.log_path, self.timeout_s = cmd, env, f"http://127.0.0.1:{port}", \
            log_path, timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ProfileServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 - the child owns it until __exit__
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server exited with {self.proc.returncode} (log {self.log_path}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1.0)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server did not answer within {self.timeout_s:.0f} s (log {self.log_path})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        return post_json(self.url, path, body, timeout)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=120) as r:
            return json.loads(r.read())


def arm_fraction(arm: str, gamma: int) -> float:
    """dspark_force_budget_frac of an arm: off = a width cap of 1; spec = a cap of γ+1 (any f < 1 above γ/(γ+1))."""
    return 1.0 / (gamma + 1) if arm == "off" else (gamma + 0.5) / (gamma + 1)


def run_profile(server: ProfileServer, plan: ProfilePlan, gamma: int, vocab_size: int, say=print) -> dict:
    """Drive the arms and return the DSPARK record of /server_info (reading it writes the cost table)."""
    rng = random.Random(plan.seed)
    sampling = {"max_new_tokens": plan.new_tokens, "temperature": 0.0, "ignore_eos": True}

    def generate(ids: list[int]) -> dict:
        return server.post("/generate", {"input_ids": ids, "sampling_params": sampling})

    for b in plan.batch_sizes:
        prompts = [[rng.randrange(100, vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(b)]
        for r in range(plan.repeats):
            for arm in (("off", "spec") if r % 2 == 0 else ("spec", "off")):
                frac = arm_fraction(arm, gamma)
                server.post("/set_internal_state", {"server_args": {"dspark_force_budget_frac": frac}})
                server.post("/flush_cache", {})
                t0 = time.perf_counter()
                with ThreadPoolExecutor(b) as pool:
                    list(pool.map(generate, prompts))
                say(f"  batch {b} (bucket {batch_bucket(b)}), round {r + 1}/{plan.repeats}, {arm}: "
                    f"{b * plan.new_tokens / (time.perf_counter() - t0):.1f} tok/s")
    server.post("/set_internal_state", {"server_args": {"dspark_force_budget_frac": 1.0}})  # the rule decides again
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]


def cost_rows(table: dict) -> list[dict]:
    """Per bucket of a saved cost table: off, draft and after(w) medians in ms (None: not measured)."""
    def ms(samples: list[float]) -> float | None:  # the median CostTable prices with (RunningCost.value)
        return None if not samples else round(1e3 * statistics.median(samples), 2)

    return [{"bucket": int(b), "off_ms": ms(c["off"]), "draft_ms": ms(c["draft"]),
             "after_ms": [ms(s) for s in c["after"]], "samples": len(c["off"]) + len(c["draft"])}
            for b, c in sorted(table["buckets"].items(), key=lambda kv: int(kv[0]))]
