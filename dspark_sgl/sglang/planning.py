"""Verify planning for the SGLang worker: speculate or not, which policy, which costs, which STS temperatures, and the
numbers `/server_info` reports. The rule itself is the shared `dspark_sgl.speculative.scheduler.FullCostRule`.

Speculate or not. Before drafting, every decode step asks the full-cost rule, from earlier steps only, whether a
speculative step is expected to commit tokens faster than a plain ("off") step at this batch size, with every cost
counted (draft, verify at each width, acceptance and commit). The costs come from the worker's own step timings
(steptime.py), per batch bucket x verify width, never from extra forwards inside a live step; a new bucket times a few
speculative steps and a few off steps first (the rule's cold start), and every 64th decision of a bucket runs the other
arm once to keep its cost fresh. The learnt table persists in a per-machine cache (`$DSPARK_SGL_SPS_CACHE`, default
`$XDG_CACHE_HOME/dspark-sgl/sps/`, `off` disables it), one file per engine (`engine_facts`), so a restart starts with
the costs measured before. Operators: `--json-model-override-args '{"dspark_speculate": "auto"|"on"|"off",
"dspark_speculate_max_batch": N}'` (`dspark serve --speculate`, `--speculate-max-batch`), and at run time SGLang's
admin-protected `/set_internal_state` with `dspark_force_budget_frac` (1: the rule; f < 1: speculate on every step at
width <= ceil(f (γ+1)); width 1 = off).

Policy. SGLang's own switch `SGLANG_RAGGED_VERIFY_MODE` picks it, so one setting drives the builtin and ours:
`static` verifies γ+1 tokens per request on every step (speculation always on unless dspark_speculate says
otherwise: a fixed schedule); `compact` / `cap-accept` run the full-cost schedule. Unset, we default to `confidence`
whenever the draft has a confidence head (the builtin defaults to static, which leaves the head unused).

A verify-only SPS table (`--speculative-dspark-sps-table-path FILE` holding `tokens`/`steps_per_s`, or a live update's
sps.json) is still honoured for the width after drafting (the verify-only padded rule); the decision to speculate is
the full-cost rule's either way. A FILE holding a cost table (`buckets`) is loaded as the start-up profile; a FILE
that does not exist receives the learnt cost table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dspark_sgl.faults import planted
from dspark_sgl.sglang.steptime import costs_of_step
from dspark_sgl.speculative.scheduler import (
    CostTable,
    Decision,
    FullCostRule,
    RuleConfig,
    batch_bucket,
    draft_rows,
    schedule,
)
from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.sts import apply_sts, load_sts
from dspark_sgl.targets.smollm2 import cache_root

logger = logging.getLogger(__name__)
POLICY_FROM_SGLANG_MODE = {"static": "static", "cap-accept": "confidence", "compact": "confidence"}
SPS_CACHE_ENV = "DSPARK_SGL_SPS_CACHE"  # a folder, or "off"; default $XDG_CACHE_HOME/dspark-sgl/sps
SAVE_EVERY = 512  # decode steps between writes of the learnt cost table (also written whenever /server_info is read
# and whenever a bucket's cold start has timed both arms)


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
    """The power of two at or above batch_size."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class BucketRecord:
    """What /server_info reports per batch bucket: decode steps, how many speculated, the verify-width histogram, and
    predicted vs realized tokens per request of the speculative steps (realized stays on the device)."""

    steps: int = 0
    speculated: int = 0  # the match steps included
    match_steps: int = 0  # steps that verified matches from the text alone (no draft pass)
    widths: dict[int, int] = field(default_factory=dict)
    rows: int = 0  # request-steps that speculated
    predicted: float = 0.0  # summed over those request-steps: 1 + E[accepted] as predicted before drafting
    realized: Tensor | int = 0  # summed: 1 + accepted
    # the worker's timed steps, any kind: (seconds, what ran: "off", "draft w5", "match w8", "forced w8", ...)
    step_s: deque = field(default_factory=lambda: deque(maxlen=1024))

    def to_dict(self) -> dict:
        n = max(self.rows, 1)
        return {"steps": self.steps, "speculated_share": round(self.speculated / max(self.steps, 1), 4),
                "match_step_share": round(self.match_steps / max(self.steps, 1), 4),
                "width_hist": {str(w): c for w, c in sorted(self.widths.items())},
                "predicted_accept_length": round(self.predicted / n, 4) if self.rows else None,
                "realized_accept_length": round(float(self.realized) / n, 4) if self.rows else None,
                "step_time_ms": step_spread(self.step_s)}


def step_spread(steps) -> dict | None:
    """The worker's step times of a bucket (last 1,024 (seconds, kind) pairs; off, match and speculative steps alike):
    median, p99, max, how many took more than twice the median (issue 41's "no decode step longer than 2x its
    bucket's median") and what those were (kind and width: a rule that priced them within its bound, or a box that
    ran them slow, tell apart by it)."""
    if not steps:
        return None
    ms = sorted(1e3 * t for t, _ in steps)
    median = ms[len(ms) // 2]
    over = Counter(kind for t, kind in steps if 1e3 * t > 2 * median)
    return {"timed": len(ms), "median": round(median, 2), "p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
            "max": round(ms[-1], 2), "over_2x_median": sum(over.values()),
            "over_2x_kinds": dict(sorted(over.items()))}


@dataclass
class VerifyPlanner:
    policy: str  # "static" | "confidence"
    gamma: int
    rule: FullCostRule
    temperatures: Tensor | None = None  # STS, per position
    sps: SpsTable | None = None  # an operator's or a release's verify-only table (widths only), else None
    save_path: Path | None = None  # where the learnt cost table is written
    forced_width: int | None = None  # /set_internal_state dspark_force_budget_frac: a fixed width (1 = off)
    steps: int = 0
    requests: int = 0
    verified_drafts: Tensor | int = 0  # scheduled drafts, summed over requests and steps (stays on the device)
    run_tokens: int = 0  # tokens the target actually ran (batch × window)
    accepted: Tensor | int = 0  # stays on the device: recording a step costs no host sync
    buckets: dict[int, BucketRecord] = field(default_factory=dict)
    _timed: int = field(default=0, repr=False)  # steps timed since start
    _priced: int = field(default=0, repr=False)  # buckets with both arms timed, at the last save

    @classmethod
    def from_server_args(cls, spec, draft, cache_file: Path | None = None, mode: str | None = None,
                         max_batch: int | None = None) -> VerifyPlanner:
        """The planner of one worker. `cache_file` (sps_cache_file) applies when no table path was given; `mode` and
        `max_batch`: the operator's dspark_speculate / dspark_speculate_max_batch (None: auto, uncapped; the static
        policy speculates on every step unless told otherwise)."""
        gamma = draft.config.block_size
        policy = choose_policy(draft.confidence_head is not None, os.environ.get("SGLANG_RAGGED_VERIFY_MODE"))
        sts_path = spec.speculative_dspark_confidence_sts_path
        if sts_path:
            temps = load_sts(sts_path, gamma)
        elif draft.config.sts_temperatures is not None:
            temps = torch.tensor(draft.config.sts_temperatures, dtype=torch.float64)
        else:
            temps = None
        config = RuleConfig(mode=mode or ("on" if policy == "static" else "auto"),
                            max_batch=None if max_batch is None else int(max_batch))
        planner = cls(policy, gamma, FullCostRule(gamma, config=config), temps)
        path = spec.speculative_dspark_sps_table_path
        if path and Path(path).is_file():
            planner._load(Path(path), trusted=True)
        elif path:
            planner.save_path = Path(path)
        elif cache_file is not None:
            planner.save_path = cache_file
            if cache_file.is_file():
                planner._load(cache_file, trusted=False)
            else:
                logger.info("dspark-sgl step costs: learnt from the served steps, kept in %s", cache_file)
        return planner

    def _load(self, file: Path, trusted: bool) -> None:
        """A cost table (`buckets`: the start-up profile) or a verify-only SPS table (`tokens`: widths by it). An
        unreadable cache is learnt anew and overwritten; an unreadable operator file is an error."""
        try:
            d = json.loads(file.read_text())
            if "buckets" in d:
                costs = CostTable.from_dict(d)
                if costs.width != self.gamma + 1:
                    raise ValueError(f"cost table for width {costs.width}, verify window {self.gamma + 1}")
                self.rule.costs = costs
            elif trusted:
                self.sps = SpsTable.from_dict(d).smoothed()
            else:
                raise ValueError("not a cost table")
        except (ValueError, KeyError, TypeError) as e:
            if trusted:
                raise ValueError(f"dspark-sgl: {file} is neither a cost table nor an SPS table: {e}") from e
            logger.warning("dspark-sgl step-cost cache %s unreadable (%s): learning anew", file, e)
            return
        if not trusted:
            self.save_path = file
        logger.info("dspark-sgl step costs: buckets %s loaded from %s (delete it to measure again)",
                    sorted(self.rule.costs.buckets), file)

    def state(self) -> dict:
        """What `adopt` takes (rank 0's start-up costs and table go to every TP rank)."""
        return {"costs": self.rule.costs.to_dict(), "sps": None if self.sps is None else self.sps.to_dict()}

    def adopt(self, state: dict) -> None:
        self.rule.costs = CostTable.from_dict(state["costs"])
        self.sps = None if state.get("sps") is None else SpsTable.from_dict(state["sps"])

    def use_release(self, sts: list[float] | None, sps: SpsTable | None) -> None:
        """A live draft update (weights.py): its STS temperatures or none (the old ones were fitted to the old
        draft), and its SPS table if it brings one. The draft's cost is the same network's; its acceptance is not:
        the per-position statistics start again."""
        self.temperatures = None if sts is None else torch.tensor(sts, dtype=torch.float64)
        if sps is not None:
            self.sps = sps.smoothed()
        self.rule.forget_acceptance()

    def set_forced_fraction(self, frac: float | None) -> None:
        """SGLang's dspark_force_budget_frac (its HTTP hook takes numbers in (0, 1] only): 1 (or None) gives the
        decision back to the rule (or the operator's mode); f < 1 speculates on every step with the width capped at
        ceil(f (γ+1)) (the rule picks within it); a cap of 1 (f <= 1/(γ+1)) runs an off step on every step."""
        auto = frac is None or float(frac) >= 1.0
        self.forced_width = None if auto else max(1, math.ceil(float(frac) * (self.gamma + 1)))
        logger.info("dspark-sgl: speculation %s", "by the full-cost rule" if self.forced_width is None else
                    f"forced: verify width <= {self.forced_width}" + (" (off)" if self.forced_width == 1 else ""))

    def decide(self, batch_size: int, match: Tensor | None = None, keys: list | None = None) -> Decision:
        """Before drafting: speculate this step? The operator's switch, else the full-cost rule (`match`: the survival
        of the rows' matches, the hybrid; `keys`: the rows' requests, for their own acceptance). A logprob request
        changes nothing: its logprobs are read from the columns this step verifies, whatever their width."""
        if self.forced_width is not None:
            return Decision(self.forced_width > 1, "forced")
        return self.rule.decide(batch_size, match, keys)

    def match_allowed(self, decision: Decision) -> bool:
        """May an off step verify the hybrid's matches instead (FullCostRule.match_width prices it)? Not when the
        operator forced the step (the run-time switch or mode "off"): forced off means plain decoding."""
        return not decision.speculate and decision.why != "forced"  # `decide` says "forced" for both

    def verify_lengths(self, conf_logits: Tensor | None, batch_size: int, device) -> Tensor:
        """Per-request verify length (anchor + scheduled drafts) in [1, γ+1], long, on device (one width for all)."""
        conf = None if conf_logits is None else self.survival_factors(conf_logits)
        return self.lengths_from_conf(conf, batch_size, device)

    def lengths_from_conf(self, conf: Tensor | None, batch_size: int, device) -> Tensor:
        """verify_lengths from survival factors of any proposer (the hybrid's rows mix the draft's and a match's)."""
        lengths = torch.full((batch_size,), self.gamma + 1, dtype=torch.long, device=device)
        if self.policy == "confidence" and conf is not None:
            # the worker's verify pads every row to the longest: one width for the batch (the padded rules)
            lengths = schedule(conf, self.sps, "confidence", padded=True) if self.sps is not None \
                else self.rule.widths(conf, bounded=self.forced_width is None)
        return lengths if self.forced_width is None else lengths.clamp(max=self.forced_width)

    def host_width(self, conf_logits: Tensor | None) -> int | None:
        """The width `verify_lengths` gives every row when the host knows it without reading them (static, no
        confidence head); None when it depends on this step's confidences."""
        if self.policy == "static" or conf_logits is None:
            return self.gamma + 1 if self.forced_width is None else min(self.forced_width, self.gamma + 1)
        return None

    def survival_factors(self, conf_logits: Tensor) -> Tensor:
        return apply_sts(conf_logits.float(), self._temps(conf_logits.device))

    calibrated = survival_factors  # the name the hybrid's engines share (speculative/scheduler.py's planners)

    def record_step(self, batch_size: int, decision: Decision, width: int) -> None:
        rec = self.buckets.setdefault(batch_bucket(batch_size), BucketRecord())
        rec.steps += 1
        rec.match_steps += decision.why == "match"
        if decision.speculate:
            rec.speculated += 1
            rec.widths[width] = rec.widths.get(width, 0) + 1

    def record(self, lengths: Tensor, width: int, accepted: Tensor, decision: Decision,
               conf_logits: Tensor | None = None, conf: Tensor | None = None, from_match: Tensor | None = None,
               keys: list | None = None) -> None:
        """A speculative step's outcome: totals, the bucket's predicted vs realized, the rule's acceptance (of the
        rows that verified the draft's block: `from_match` [B] marks the hybrid's rows that verified a match)."""
        bs = lengths.numel()
        self.steps += 1
        self.requests += bs
        self.verified_drafts = self.verified_drafts + (lengths - 1).sum()
        self.run_tokens += bs * width
        self.accepted = self.accepted + accepted.sum()
        rec = self.buckets.setdefault(batch_bucket(bs), BucketRecord())
        rec.rows += bs
        rec.predicted += decision.predicted * bs
        rec.realized = rec.realized + (accepted + 1).sum()
        if decision.why == "match" and not planted("match_step_stats"):
            return  # a match step's acceptance is the matcher's (per request and match length), never the draft's
        if conf is None and conf_logits is not None:
            conf = self.survival_factors(conf_logits)
        self.rule.observe_accept(bs, width, accepted, conf, draft_rows(from_match), keys)

    def observe_timing(self, meta: dict, seconds: dict[str, float]) -> None:
        """StepTimes' callback: one finished step's phases feed the cost table (a speculative step: draft phases and
        the rest at its width; an off step: its whole time)."""
        bs, spec = meta["batch_size"], meta["speculate"]
        draft_s, after_s = costs_of_step(seconds)
        width = int(meta.get("width", 1))
        kind = ("match" if meta.get("match") else "forced" if meta.get("forced") and spec else "draft" if spec
                else "off") + (f" w{width}" if width > 1 else "")
        self.buckets.setdefault(batch_bucket(bs), BucketRecord()).step_s.append((draft_s + after_s, kind))
        served = not meta.get("forced")  # a forced step (the profile's arms) is no sample of the served mix
        if meta.get("match"):  # no draft pass: T_after(width) only
            self.rule.observe_match(bs, width, after_s, served)
        elif spec:
            self.rule.observe_spec_costs(bs, width, draft_s, after_s, served)
        else:
            self.rule.observe_off(bs, after_s, served)
        self._timed += 1
        priced = sum(b.off.seen > 0 and b.draft.seen > 0 for b in self.rule.costs.buckets.values())
        if priced > self._priced or self._timed % SAVE_EVERY == 0:  # a bucket's both arms now known, or periodically
            self._priced = priced
            self.save()

    def save(self) -> None:
        """The learnt costs, written whole (a temporary file renamed over it); never an operator's SPS table."""
        if self.save_path is None or self.sps is not None or not self.rule.costs.buckets:
            return
        file = self.save_path
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.rule.costs.to_dict()) + "\n")
        os.replace(tmp, file)

    def info(self) -> dict:
        """What `/server_info` shows under internal_states[...]["dspark_info_record"]."""
        n = max(self.requests, 1)
        self.save()
        return {
            "worker": "dspark-sgl",
            "schedule": self.policy,
            "speculate": self.rule.config.mode if self.forced_width is None else f"width {self.forced_width}",
            "speculate_max_batch": self.rule.config.max_batch,
            "decode_steps": self.steps,
            "mean_scheduled_drafts": float(self.verified_drafts) / n,
            "mean_target_tokens_per_request": self.run_tokens / n,
            "mean_accepted_drafts": float(self.accepted) / n,
            "buckets": {str(b): r.to_dict() for b, r in sorted(self.buckets.items())},
            "rule": self.rule.info(),
            "sts": None if self.temperatures is None else [float(t) for t in self.temperatures],
            "sps_table": None if self.sps is None else self.sps.to_dict(),
            "cost_table": None if self.save_path is None or self.sps is not None else str(self.save_path),
        }

    def clear(self) -> None:
        self.steps = self.requests = self.verified_drafts = self.run_tokens = self.accepted = 0
        self.buckets.clear()

    def _temps(self, device) -> Tensor | None:
        if self.temperatures is None:
            return None
        if self.temperatures.device != torch.device(device):
            self.temperatures = self.temperatures.to(device)
        return self.temperatures
