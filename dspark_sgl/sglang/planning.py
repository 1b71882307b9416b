"""Verify planning for the SGLang worker: which policy, which SPS table, which STS temperatures, and the numbers
`/server_info` reports. The scheduling rule itself is the shared `dspark_sgl.speculative.scheduler.schedule`.

Policy. SGLang's own switch `SGLANG_RAGGED_VERIFY_MODE` picks it, so one setting drives the builtin and ours:
`static` verifies γ+1 tokens per request; `compact` / `cap-accept` run the confidence schedule. Unset, we default to
`confidence` whenever the draft has a confidence head (the builtin defaults to static, which leaves the head unused).

SPS table. `--speculative-dspark-sps-table-path FILE` loads FILE when it exists, and trusts it for every batch size.
Otherwise the worker measures the table itself on the live engine: the first decode batch of each new batch-size
bucket (1, 2, 4, ...) is also timed at verify widths 1..γ+1 before its real verify. Those probe forwards write target
KV only into the step's own verify-window slots, which the real verify overwrites, so they change no output. When
FILE was given but missing, the measured table is written there for the next start.

Without FILE the measurements persist in a per-machine cache (`$DSPARK_SGL_SPS_CACHE`, default
`$XDG_CACHE_HOME/dspark-sgl/sps/`, `off` disables it), one file per engine (`engine_facts`: target, dtype, device,
TP, verify width, attention backend, versions). A restart loads the buckets measured before and profiles only new
ones, so the scheduler does not stall the first requests of every bucket again (the TTFT tail of
docs/serving.md's load table). Under TP, rank 0's table and buckets go to every rank at start-up (`adopt`): each
probe is a collective forward, so every rank must profile the same buckets at the same step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dspark_sgl.speculative.scheduler import schedule
from dspark_sgl.speculative.sps import SpsTable, isotonic_non_increasing
from dspark_sgl.speculative.sts import apply_sts, load_sts
from dspark_sgl.targets.smollm2 import cache_root

logger = logging.getLogger(__name__)
POLICY_FROM_SGLANG_MODE = {"static": "static", "cap-accept": "confidence", "compact": "confidence"}
SPS_CACHE_ENV = "DSPARK_SGL_SPS_CACHE"  # a folder, or "off"; default $XDG_CACHE_HOME/dspark-sgl/sps


def choose_policy(has_confidence_head: bool, sglang_mode: str | None) -> str:
    """`static` or `confidence` from SGLang's SGLANG_RAGGED_VERIFY_MODE value (None = unset)."""
    if sglang_mode is None:
        return "confidence" if has_confidence_head else "static"
    if sglang_mode not in POLICY_FROM_SGLANG_MODE:
        raise ValueError(
            f"SGLANG_RAGGED_VERIFY_MODE={sglang_mode!r}; expected one of {sorted(POLICY_FROM_SGLANG_MODE)}"
        )
    policy = POLICY_FROM_SGLANG_MODE[sglang_mode]
    if policy == "confidence" and not has_confidence_head:
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE={sglang_mode} needs a draft with a confidence head")
    return policy


def engine_facts(server_args, device, dtype, verify_width: int) -> dict:
    """What a verify's speed depends on, besides the batch: the key of the SPS cache. Raw operator input (the same
    command on the same machine finds its table again); a changed target, dtype, device, TP size, block size,
    attention backend, graph setting or library version measures anew."""
    import sglang

    from dspark_sgl.provenance import cpu_model

    kind = torch.device(device).type
    hardware = (torch.cuda.get_device_name(torch.device(device)) if kind == "cuda"
                else f"{cpu_model()}, {torch.get_num_threads()} threads")
    raw = {name: getattr(server_args, name, None)
           for name in ("model_path", "revision", "quantization", "kv_cache_dtype", "tp_size", "attention_backend",
                        "disable_cuda_graph", "page_size")}
    return {**{k: None if v is None else str(v) for k, v in raw.items()}, "dtype": str(dtype), "device": kind,
            "hardware": hardware, "verify_width": verify_width, "sglang": sglang.__version__,
            "torch": torch.__version__}


def sps_cache_file(facts: dict) -> Path | None:
    """This engine's file in the per-machine SPS cache, or None when $DSPARK_SGL_SPS_CACHE is `off`."""
    where = os.environ.get(SPS_CACHE_ENV, "")
    if where.lower() in ("off", "0", "none", "false"):
        return None
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return (Path(where) if where else cache_root() / "sps") / f"{key}.json"


def size_bucket(batch_size: int) -> int:
    """The power of two at or above batch_size: one SPS profile per bucket."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class VerifyPlanner:
    policy: str  # "static" | "confidence"
    gamma: int
    temperatures: Tensor | None = None  # STS, per position
    sps: SpsTable | None = None  # None until loaded or measured
    save_path: Path | None = None  # where a measured table is written
    measured: dict[int, float] = field(default_factory=dict)  # batch verify tokens -> steps/s
    profiled_buckets: set[int] = field(default_factory=set)
    steps: int = 0
    requests: int = 0
    verified_drafts: Tensor | int = 0  # scheduled drafts, summed over requests and steps (stays on the device)
    run_tokens: int = 0  # tokens the target actually ran (batch × window)
    accepted: Tensor | int = 0  # stays on the device: recording a step costs no host sync

    @classmethod
    def from_server_args(cls, spec, draft, cache_file: Path | None = None) -> VerifyPlanner:
        """The planner of one worker. `cache_file` (sps_cache_file) applies when no table path was given."""
        gamma = draft.config.block_size
        policy = choose_policy(draft.confidence_head is not None, os.environ.get("SGLANG_RAGGED_VERIFY_MODE"))
        sts_path = spec.speculative_dspark_confidence_sts_path
        if sts_path:
            temps = load_sts(sts_path, gamma)
        elif draft.config.sts_temperatures is not None:
            temps = torch.tensor(draft.config.sts_temperatures, dtype=torch.float64)
        else:
            temps = None
        planner = cls(policy, gamma, temps)
        path = spec.speculative_dspark_sps_table_path
        if path and Path(path).is_file():
            planner.sps = SpsTable.load(path).smoothed()
            planner.profiled_buckets = {1 << i for i in range(31)}  # a given table is trusted for every size
        elif path:
            planner.save_path = Path(path)
        elif cache_file is not None and policy == "confidence":
            planner.save_path = cache_file
            planner._resume(cache_file)
        return planner

    def _resume(self, file: Path) -> None:
        """Load the buckets a previous start measured (raw values: new buckets merge and smooth as if measured now).
        An unreadable file is measured anew and overwritten."""
        if not file.is_file():
            logger.info("dspark-sgl SPS table: measured per batch-size bucket, kept in %s", file)
            return
        try:
            table = SpsTable.load(file)
            raw, buckets = table.meta["raw_steps_per_s"], table.meta["buckets"]
            self.adopt({"measured": dict(zip(table.tokens, raw, strict=True)), "buckets": buckets})
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("dspark-sgl SPS cache %s unreadable (%s): measuring anew", file, e)
            return
        logger.info("dspark-sgl SPS table: buckets %s loaded from %s (delete it to measure again)", buckets, file)

    def state(self) -> dict:
        """What `adopt` takes: the raw measurements and the profiled buckets (rank 0's go to every TP rank)."""
        return {"measured": dict(self.measured), "buckets": sorted(self.profiled_buckets),
                "sps": None if self.sps is None else self.sps.to_dict()}

    def adopt(self, state: dict) -> None:
        self.measured = {int(t): float(v) for t, v in state["measured"].items()}
        self.profiled_buckets = {int(b) for b in state["buckets"]}
        if state.get("sps") is not None:
            self.sps = SpsTable.from_dict(state["sps"])
        elif self.measured:
            self.sps = self._smooth()

    def use_release(self, sts: list[float] | None, sps: SpsTable | None) -> None:
        """A live draft update (weights.py): its STS temperatures or none (the old ones were fitted to the old
        draft), and its SPS table if it brings one (else the engine's stays: SPS is the target's and hardware's)."""
        self.temperatures = None if sts is None else torch.tensor(sts, dtype=torch.float64)
        if sps is not None:
            self.sps = sps.smoothed()
            self.profiled_buckets = {1 << i for i in range(31)}

    def needs_profile(self, batch_size: int) -> bool:
        return self.policy == "confidence" and size_bucket(batch_size) not in self.profiled_buckets

    def add_profile(self, batch_size: int, steps_per_s_by_width: dict[int, float]) -> None:
        """Merge one bucket's measurements (verify width -> steps/s at this batch size) into the table."""
        self.profiled_buckets.add(size_bucket(batch_size))
        for width, sps in steps_per_s_by_width.items():
            self.measured[batch_size * width] = sps
        self.sps = self._smooth()
        logger.info("dspark-sgl SPS table (batch tokens -> steps/s): %s",
                    ", ".join(f"{t}:{s:.1f}" for t, s in zip(self.sps.tokens, self.sps.steps_per_s, strict=True)))
        if self.save_path is not None:
            self.sps.save(self.save_path)

    def _smooth(self) -> SpsTable:
        tokens = sorted(self.measured)
        raw = [self.measured[t] for t in tokens]
        meta = {"source": "dspark-sgl worker, measured on the live engine", "raw_steps_per_s": raw,
                "buckets": sorted(self.profiled_buckets)}
        return SpsTable(tokens, isotonic_non_increasing(raw), meta)

    def verify_lengths(self, conf_logits: Tensor | None, batch_size: int, device) -> Tensor:
        """Per-request verify length (anchor + scheduled drafts) in [1, γ+1], long, on device."""
        if self.policy == "static" or conf_logits is None or self.sps is None:
            return torch.full((batch_size,), self.gamma + 1, dtype=torch.long, device=device)
        conf = apply_sts(conf_logits.float(), self._temps(conf_logits.device))
        return schedule(conf, self.sps, "confidence", padded=True)  # the worker's verify pads to the longest row

    def calibrated(self, conf_logits: Tensor) -> Tensor:
        """The STS-calibrated confidences [B, γ] of raw confidence logits."""
        return apply_sts(conf_logits.float(), self._temps(conf_logits.device))

    def lengths_from_conf(self, conf: Tensor, batch_size: int, device) -> Tensor:
        """verify_lengths from calibrated confidences (the hybrid's rows mix the draft's and a match's)."""
        if self.policy == "static" or self.sps is None:
            return torch.full((batch_size,), self.gamma + 1, dtype=torch.long, device=device)
        return schedule(conf, self.sps, "confidence", padded=True)

    def record(self, lengths: Tensor, width: int, accepted: Tensor) -> None:
        self.steps += 1
        self.requests += lengths.numel()
        self.verified_drafts = self.verified_drafts + (lengths - 1).sum()
        self.run_tokens += lengths.numel() * width
        self.accepted = self.accepted + accepted.sum()

    def info(self) -> dict:
        """What `/server_info` shows under internal_states[...]["dspark_info_record"]."""
        n = max(self.requests, 1)
        return {
            "worker": "dspark-sgl",
            "schedule": self.policy,
            "decode_steps": self.steps,
            "mean_scheduled_drafts": float(self.verified_drafts) / n,
            "mean_target_tokens_per_request": self.run_tokens / n,
            "mean_accepted_drafts": float(self.accepted) / n,
            "sts": None if self.temperatures is None else [float(t) for t in self.temperatures],
            "sps_table": None if self.sps is None else self.sps.to_dict(),
        }

    def clear(self) -> None:
        self.steps = self.requests = self.verified_drafts = self.run_tokens = self.accepted = 0

    def _temps(self, device) -> Tensor | None:
        if self.temperatures is None:
            return None
        if self.temperatures.device != torch.device(device):
            self.temperatures = self.temperatures.to(device)
        return self.temperatures
