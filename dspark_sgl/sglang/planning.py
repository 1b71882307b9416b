"""Verify planning for the SGLang worker: which policy, which SPS table, which STS temperatures, and the numbers
`/server_info` reports. The scheduling rule itself is the shared `dspark_sgl.speculative.scheduler.schedule`.

Policy. SGLang's own switch `SGLANG_RAGGED_VERIFY_MODE` picks it, so one setting drives the builtin and ours:
`static` verifies γ+1 tokens per request; `compact` / `cap-accept` run the confidence schedule. Unset, we default to
`confidence` whenever the draft has a confidence head (the builtin defaults to static, which leaves the head unused).

SPS table. `--speculative-dspark-sps-table-path FILE` loads FILE when it exists. Otherwise the worker measures the
table itself on the live engine: the first decode batch of each new batch-size bucket (1, 2, 4, ...) is also timed
at verify widths 1..γ+1 before its real verify. Those probe forwards write target KV only into the step's own
verify-window slots, which the real verify overwrites, so they change no output. When FILE was given but missing,
the measured table is written there for the next start.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dspark_sgl.speculative.scheduler import schedule
from dspark_sgl.speculative.sps import SpsTable, isotonic_non_increasing
from dspark_sgl.speculative.sts import apply_sts, load_sts

logger = logging.getLogger(__name__)
POLICY_FROM_SGLANG_MODE = {"static": "static", "cap-accept": "confidence", "compact": "confidence"}


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
    def from_server_args(cls, spec, draft) -> VerifyPlanner:
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
        return planner

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
        tokens = sorted(self.measured)
        smooth = isotonic_non_increasing([self.measured[t] for t in tokens])
        self.sps = SpsTable(tokens, smooth, {"source": "dspark-sgl worker, measured on the live engine",
                                             "raw_steps_per_s": [self.measured[t] for t in tokens]})
        logger.info("dspark-sgl SPS table (batch tokens -> steps/s): %s",
                    ", ".join(f"{t}:{s:.1f}" for t, s in zip(tokens, smooth, strict=True)))
        if self.save_path is not None:
            self.sps.save(self.save_path)

    def verify_lengths(self, conf_logits: Tensor | None, batch_size: int, device) -> Tensor:
        """Per-request verify length (anchor + scheduled drafts) in [1, γ+1], long, on device."""
        if self.policy == "static" or conf_logits is None or self.sps is None:
            return torch.full((batch_size,), self.gamma + 1, dtype=torch.long, device=device)
        conf = apply_sts(conf_logits.float(), self._temps(conf_logits.device))
        return schedule(conf, self.sps, "confidence")

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
