"""Hardware-aware prefix scheduler (DSpark Algorithm 1 with an optimistic look-ahead): how many draft tokens each
request verifies.

Survival a[r, j] = prod_{i<=j} c[r, i] is the chance draft j of request r is accepted. Candidates (r, j)
are admitted in descending a; with k admitted the step is expected to commit tau_k = R + sum of their a
(one bonus token per request) at SPS(R + k) steps/s, so throughput is Theta_k = tau_k * SPS(R + k).

Which candidates may decide whether (r, j) is admitted is what keeps speculative sampling exact: only candidates
ranked at or above it, i.e. c[r, <=j] (functions of x[r, <j]) and other requests, never the draft token x[r, j]
under test. Taking the argmax of Theta over all k "peeks" at a[r, j+1], which depends on x[r, j], and biases the
output (tests/test_scheduler.py shows it). The paper stops at the first candidate that does not raise Theta. That is
exact but myopic: a measured SPS table is a step function (a CPU or graph bucket switches kernels at some batch
size), and one step down can stop admission although whole blocks past it would pay (issue 26's TP=1 run: lengths
[2, 2, 2, 1] at 4 requests where 4 x 7 drafts were worth about 1.9x more). So candidate i is admitted while some
longer prefix could still beat Theta_i if every later candidate had survival a_i: an upper bound, since later
candidates have survival <= a_i, built from candidates ranked at or above i only, so exactness holds by the same
argument. The bound needs Theta only at the ends of the table's plateaus (within one plateau it grows with the
prefix), so it costs O(N x table size) for N = R x gamma candidates. Every candidate the first-dip rule admits is
admitted here too.

A padded verify (every request of the batch runs the same width w; SGLang's worker on CPU, where no ragged layout
exists) costs SPS(R x w) whatever the per-request lengths, so trimming one request below w saves nothing and loses
its drafts' chances. `padded_verify_lengths` therefore chooses one width for the whole batch, column by column:
draft column d joins while some wider window could still beat Theta_d if every later column had column d's summed
survival (the same look-ahead bound). Column d's decision reads survivals of columns <= d only, i.e. c[r, <=d],
functions of x[r, <d]: exact by the same argument.

Everything is vectorised torch on the confidences' device, with no host sync.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from dspark_sgl.faults import planted
from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.sts import apply_sts

if TYPE_CHECKING:
    from dspark_sgl.speculative.markov import Proposal

Policy = Literal["static", "confidence"]
POLICIES: tuple[str, ...] = ("static", "confidence")


def draft_rows(from_match: torch.Tensor | None) -> torch.Tensor | None:
    """The rows whose outcome is the draft's [R] bool, from the hybrid's per-row source (None: every row)."""
    if from_match is None or planted("match_rows_stats"):  # planted: the match rows' acceptance taken as the draft's
        return None
    return ~from_match.to(torch.bool)


def _check_conf(conf: torch.Tensor) -> None:
    if not isinstance(conf, torch.Tensor) or conf.dim() != 2 or not conf.is_floating_point():
        shape = tuple(conf.shape) if isinstance(conf, torch.Tensor) else type(conf).__name__
        raise ValueError(f"confidences must be a float tensor [requests, gamma], got {shape}")


def rank_candidates(conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All (r, j) by survival descending, ties by position then request, so that admitting a prefix of
    this order always admits a prefix of positions per request. Returns (survival [R*g] float64,
    request id [R*g] long, 0-based draft position [R*g] long). NaN confidences count as 0; values are
    clamped to [0, 1]."""
    _check_conf(conf)
    c = conf.detach().to(torch.float64).nan_to_num(0.0).clamp(0.0, 1.0)
    survival = c.cumprod(dim=1)  # non-increasing along j, exactly, since every factor is <= 1
    flat = survival.t().reshape(-1)  # index j * R + r: a stable sort then breaks ties by (j, r)
    a_sorted, idx = torch.sort(flat, descending=True, stable=True)
    return a_sorted, idx % conf.shape[0], idx // conf.shape[0]


def throughput_curve(a_sorted: torch.Tensor, num_requests: int, sps: SpsTable) -> torch.Tensor:
    """Theta_k = (R + sum_{i<k} a_sorted[i]) * SPS(R + k) for k = 0 .. len(a_sorted)."""
    tau = torch.cat([a_sorted.new_zeros(1), a_sorted.cumsum(0)]) + num_requests
    batch_tokens = torch.arange(a_sorted.numel() + 1, device=a_sorted.device) + num_requests
    return tau * sps.lookup(batch_tokens)


def lookahead_admitted(a_sorted: torch.Tensor, num_requests: int, sps: SpsTable) -> torch.Tensor:
    """Number of candidates admitted (0-dim long): the leading run of candidates i for which
    max_{m >= i} (tau_i + (m - i + 1) * a_i) * SPS(R + m + 1) > Theta_i (see the module docstring)."""
    n, dev = a_sorted.numel(), a_sorted.device
    tau = torch.cat([a_sorted.new_zeros(1), a_sorted.cumsum(0)[:-1]]) + num_requests  # tau_i, i admitted
    theta = throughput_curve(a_sorted, num_requests, sps)[:-1]  # Theta_i, i = 0 .. n-1
    # plateau ends: batch tokens t - 1 for every measured count t after the first, as prefix indices m
    ends = sps.counts(dev)[1:] - num_requests - 2
    ends = torch.where((ends >= 0) & (ends < n - 1), ends, n - 1)
    ends = torch.cat([ends, torch.full((1,), n - 1, dtype=ends.dtype, device=dev)])
    i = torch.arange(n, device=dev)[:, None]
    extra = (ends[None, :] - i + 1).to(a_sorted.dtype)  # candidates i .. m, each counted at survival a_i
    bound = (tau[:, None] + extra * a_sorted[:, None]) * sps.lookup(ends + num_requests + 1)[None, :]
    bound = bound.masked_fill(ends[None, :] < i, float("-inf")).amax(dim=1)
    return (bound > theta).long().cumprod(0).sum()


def lengths_from_admitted(
    request_ids: torch.Tensor, num_admitted: torch.Tensor, num_requests: int
) -> torch.Tensor:
    """Per-request verify length = 1 (anchor) + its candidates among the first num_admitted ranked."""
    admitted = (torch.arange(request_ids.numel(), device=request_ids.device) < num_admitted).long()
    counts = torch.zeros(num_requests, dtype=torch.long, device=request_ids.device)
    return counts.scatter_add_(0, request_ids, admitted) + 1


def confidence_verify_lengths(conf: torch.Tensor, sps: SpsTable) -> torch.Tensor:
    """Algorithm 1 with the look-ahead. conf [R, gamma] (calibrated per-position confidences) -> verify lengths [R]
    long in [1, gamma + 1], on conf's device."""
    _check_conf(conf)
    num_requests = conf.shape[0]
    if conf.numel() == 0:
        return torch.ones(num_requests, dtype=torch.long, device=conf.device)
    a_sorted, request_ids, _ = rank_candidates(conf)
    return lengths_from_admitted(request_ids, lookahead_admitted(a_sorted, num_requests, sps), num_requests)


def padded_verify_lengths(conf: torch.Tensor, sps: SpsTable) -> torch.Tensor:
    """One verify length for every request (1 + the admitted draft columns), for a verify whose cost is
    SPS(R x width). conf [R, gamma] -> lengths [R] long in [1, gamma + 1], all equal, on conf's device."""
    _check_conf(conf)
    num_requests, gamma = conf.shape
    widths = torch.arange(1, gamma + 2, device=conf.device)
    return padded_lengths_at_rates(conf, sps.lookup(num_requests * widths))


def padded_lengths_at_rates(conf: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """The padded rule on a given step rate per width: rate [gamma + 1] steps/s of a whole step whose verify is
    width w = 1 .. gamma + 1 (SPS(R x w) for the verify-only rule; 1 / (draft + verify(w) + post(w)) seconds for the
    full-cost rule). conf [R, gamma] survival factors -> lengths [R] long, all equal. Column d's decision reads
    columns <= d only (the look-ahead bound of the module docstring)."""
    _check_conf(conf)
    num_requests, gamma = conf.shape
    if conf.numel() == 0:
        return torch.ones(num_requests, dtype=torch.long, device=conf.device)
    c = conf.detach().to(torch.float64).nan_to_num(0.0).clamp(0.0, 1.0)
    column = c.cumprod(dim=1).sum(dim=0)  # A_d: expected accepted drafts in column d, non-increasing in d
    return (padded_columns(column, num_requests, rate.to(torch.float64)) + 1).expand(num_requests).clone()


def padded_columns(column: torch.Tensor, num_requests: int, rate: torch.Tensor) -> torch.Tensor:
    """Draft columns admitted (0-dim long) from the columns' summed survivals A_d [gamma] (non-increasing) and the
    step rate per width [gamma + 1]: column d joins while some wider window, counting columns d.. at A_d, could beat
    Theta_d = tau_d x rate(d + 1)."""
    gamma, dev = column.numel(), column.device
    tau = torch.cat([column.new_zeros(1), column.cumsum(0)]) + num_requests  # tau_d with d columns, d = 0..gamma
    d = torch.arange(gamma + 1, device=dev)
    theta = tau * rate  # Theta_d
    m = d[None, 1:]  # wider windows m = d+1 .. gamma
    bound = (tau[:gamma, None] + (m - d[:gamma, None]) * column[:, None]) * rate[None, 1:]
    bound = bound.masked_fill(m <= d[:gamma, None], float("-inf")).amax(dim=1)
    return (bound > theta[:gamma]).long().cumprod(0).sum()


def static_verify_lengths(
    num_requests: int, gamma: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Everyone verifies the full window: anchor + gamma drafts."""
    return torch.full((num_requests,), gamma + 1, dtype=torch.long, device=device)


def schedule(conf: torch.Tensor, sps: SpsTable | None, policy: Policy = "confidence",
             padded: bool = False) -> torch.Tensor:
    """The engines' one call: verify lengths [R] for this step under the given policy. `padded`: the engine's
    verify runs every request at the batch's longest length (one width for all: `padded_verify_lengths`)."""
    _check_conf(conf)
    if policy == "static":
        return static_verify_lengths(conf.shape[0], conf.shape[1], conf.device)
    if policy == "confidence":
        if sps is None:
            raise ValueError("the 'confidence' schedule needs an SPS table (profile one or load a JSON)")
        return padded_verify_lengths(conf, sps) if padded else confidence_verify_lengths(conf, sps)
    raise ValueError(f"unknown schedule policy {policy!r}; expected one of {POLICIES}")


@dataclass
class ConfidencePlanner:
    """The reference engine's planner: Proposal -> verify lengths [B]. Applies the STS temperatures to the
    raw confidence logits, then schedules. Engines that lag confidences call `schedule` directly.
    `padded` (default): the reference engine verifies every row at the batch's longest length, so its schedule is
    the one-width rule; False gives per-request lengths (a ragged verify's rule)."""

    sps: SpsTable | None
    temperatures: torch.Tensor | None = None
    policy: Policy = "confidence"
    padded: bool = True
    _temps_on: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {self.policy!r}; expected one of {POLICIES}")
        if self.policy == "confidence" and self.sps is None:
            raise ValueError("the 'confidence' schedule needs an SPS table (profile one or load a JSON)")

    def __call__(self, proposal: Proposal) -> torch.Tensor:
        num_requests, gamma = proposal.tokens.shape
        if self.policy == "static":
            return static_verify_lengths(num_requests, gamma, proposal.tokens.device)
        if proposal.conf_logits is None:
            raise ValueError("the 'confidence' schedule needs a draft with a confidence head")
        return self.from_conf(self.calibrated(proposal.conf_logits))

    def calibrated(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """The STS-calibrated confidences [B, γ] of raw confidence logits."""
        logits = conf_logits.float()
        return apply_sts(logits, self._temperatures(logits.device))

    def from_conf(self, conf: torch.Tensor) -> torch.Tensor:
        """Verify lengths from calibrated confidences (the hybrid's rows mix the draft's and a match's: match.py)."""
        if self.policy == "static":
            return static_verify_lengths(conf.shape[0], conf.shape[1], conf.device)
        return schedule(conf, self.sps, "confidence", self.padded)

    def _temperatures(self, device: torch.device) -> torch.Tensor | None:
        # Cached per device: a fresh host->device copy every step would be a sync point.
        if self.temperatures is None:
            return None
        key = str(device)
        if key not in self._temps_on:
            self._temps_on[key] = torch.as_tensor(self.temperatures, dtype=torch.float32, device=device)
        return self._temps_on[key]


# --- The full-cost rule: speculate this step or decode plainly, and how wide ------------------------------------
#
# A step that speculates pays the draft (block pass + rollout) and then a verify, acceptance and commit whose cost
# grows with the width w; a plain ("off") step pays one target decode. With B requests the rates are
#     spec(w) = B (1 + E[accepted | w]) / (T_draft(B) + T_after(B, w))      off = B / T_off(B)
# (T_after = verify + accept + commit of a width-w step). Before drafting, from earlier steps only, the rule speculates
# when max_w spec(w) beats off by `margin` (and keeps speculating down to margin - hysteresis; off holds for at least
# `dwell` decisions of its bucket, on for `dwell_on`). E[accepted | w] is the running per-position acceptance of earlier
# steps (of the rows that verified the draft's block). With the hybrid (speculative/match.py) each row also has a
# match from its own text, known before drafting: a drafted row then counts the better of its match and the draft
# (as the choice after drafting will), and the arm to beat is the better of a plain step and a match step (T_after
# only, no draft pass), so the draft runs only where it adds to what the text gives for free. After drafting, the
# width is the padded look-ahead rule on the full-cost rate 1 / (T_draft + T_after(w)), with this step's per-request
# survivals corrected by the running ratio realized / predicted per position (the confidence head's calibration,
# learnt online). The decision to draft reads nothing of this step, and column d's width decision
# reads columns <= d only: exact at every temperature by the argument of the module docstring.

Mode = Literal["auto", "on", "off", "match"]
MODES: tuple[str, ...] = ("auto", "on", "off", "match")  # match: never draft; off steps may verify matches


def batch_bucket(batch_size: int) -> int:
    """The cost and acceptance bucket of a batch: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (the smallest at or above
    batch_size; half-octave steps so that B = 9 does not borrow B = 16's costs)."""
    if batch_size <= 4:
        return max(int(batch_size), 1)
    p = 1 << (int(batch_size) - 1).bit_length()
    return p * 3 // 4 if batch_size <= p * 3 // 4 else p


def buckets_up_to(batch_size: int) -> tuple[int, ...]:
    """Every bucket `batch_bucket` gives for batches 1 .. batch_size (16: 1, 2, 3, 4, 6, 8, 12, 16): what a start-up
    profile measures so that no bucket a server reaches on the way (a batch of 8 drains through 6) starts cold."""
    return tuple(sorted({batch_bucket(b) for b in range(1, max(int(batch_size), 1) + 1)}))


class RunningCost:
    """Seconds of one kind of step: the median of the last `window` samples (one slow step moves nothing; a machine
    that got busier moves it within `window` steps)."""

    __slots__ = ("samples", "seen")

    def __init__(self, samples: list[float] | tuple = (), window: int = 9, seen: int | None = None) -> None:
        self.samples: deque[float] = deque((float(s) for s in samples), maxlen=window)
        self.seen = len(self.samples) if seen is None else int(seen)

    def add(self, seconds: float) -> None:
        self.samples.append(float(seconds))
        self.seen += 1

    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


STEP_WINDOW = 65  # steps in a bucket's typical-step median (`BucketCosts.step`): long enough that the wide steps it
# bounds never make up half of it
SERVED_MIN = 8  # served steps a bucket times before their median, not every step's, is the bound's reference


@dataclass
class BucketCosts:
    """One batch bucket's step costs in seconds: `off` (a plain decode step), `draft` (block pass + rollout +
    schedule), `after[w - 1]` (verify + accept + commit of a width-w step, w = 1 .. W), `step` (every step's whole
    time, whatever its kind, over a longer window) and `served` (the same for the steps the rule chose, not those an
    operator forced: the bucket's typical step, which bounds its tail; see `CostTable.reference_seconds`)."""

    width: int
    off: RunningCost = field(default_factory=RunningCost)
    draft: RunningCost = field(default_factory=RunningCost)
    after: list[RunningCost] = field(default_factory=list)
    step: RunningCost = field(default_factory=lambda: RunningCost(window=STEP_WINDOW))
    served: RunningCost = field(default_factory=lambda: RunningCost(window=STEP_WINDOW))

    def __post_init__(self) -> None:
        self.after = self.after or [RunningCost() for _ in range(self.width)]

    def add_step(self, seconds: float, served: bool) -> None:
        """Every step's whole time; `served`: also a sample of the mix the rule serves (not an operator's forced
        step)."""
        self.step.add(seconds)
        if served or planted("forced_typical"):
            self.served.add(seconds)

    def after_seconds(self) -> list[float] | None:
        """T_after(w) for w = 1 .. W from the widths measured: linear between measured widths; past the widest, the
        slope between the narrowest and the widest (>= 0); below the narrowest, its value; with one measured width,
        proportional to w above it (pessimistic: a wider verify is never priced as free). Then floored: never below
        an off step (a width-1 verify without the draft) nor below a narrower width (the same forward over fewer
        columns). Medians of 9 noisy steps break both orders (a served bucket-4 table of stop 46 priced w = 2 at 115
        ms against an off step's 134, and its rule drafted for 0.24 expected tokens: 0.76x plain). None: nothing
        measured."""
        out = self._interpolated()
        if out is None or planted("cost_unordered"):
            return out
        floor = self.off.value() or 0.0
        for i, t in enumerate(out):
            floor = out[i] = max(t, floor)
        return out

    def _interpolated(self) -> list[float] | None:
        pts = [(w + 1, c.value()) for w, c in enumerate(self.after) if c.value() is not None]
        if not pts:
            return None
        (w0, t0), (w1, t1) = pts[0], pts[-1]
        slope = max((t1 - t0) / (w1 - w0), 0.0) if w1 > w0 else t1 / w1
        out = []
        for w in range(1, self.width + 1):
            if w <= w0:
                out.append(t0)
            elif w >= w1:
                out.append(t1 + slope * (w - w1))
            else:
                (wa, ta), (wb, tb) = next((a, b) for a, b in zip(pts, pts[1:], strict=False) if a[0] <= w <= b[0])
                out.append(ta + (tb - ta) * (w - wa) / (wb - wa))
        return out

    def to_dict(self) -> dict:
        return {"off": list(self.off.samples), "draft": list(self.draft.samples),
                "after": [list(c.samples) for c in self.after], "step": list(self.step.samples),
                "served": list(self.served.samples)}

    @classmethod
    def from_dict(cls, width: int, d: dict) -> BucketCosts:
        after = [RunningCost(s) for s in d["after"]]
        if len(after) != width:
            raise ValueError(f"cost table has {len(after)} widths, the verify window {width}")
        step = RunningCost(d.get("step", ()), window=STEP_WINDOW)  # absent in tables saved before stop 47
        served = RunningCost(d.get("served", ()), window=STEP_WINDOW)  # ... and before stop 51
        return cls(width, RunningCost(d["off"]), RunningCost(d["draft"]), after, step, served)


@dataclass
class CostTable:
    """Step costs per batch bucket x verify width (the 2-D table the full-cost rule prices with). Fed by profiles
    taken before serving (`from_dict` of a saved table) and corrected online by every step's recorded timings."""

    width: int  # W = gamma + 1
    buckets: dict[int, BucketCosts] = field(default_factory=dict)
    # (bucket, cell) of the cost cells this process has timed once: never saved, so a table loaded by a new process
    # warms up again (`_warm`)
    warmed: set[tuple[int, str, int]] = field(default_factory=set, repr=False, compare=False)

    def bucket(self, batch_size: int) -> BucketCosts:
        b = batch_bucket(batch_size)
        if b not in self.buckets:
            self.buckets[b] = BucketCosts(self.width)
        return self.buckets[b]

    def _warm(self, batch_size: int, cell: str, width: int = 0) -> bool:
        """False the first time this process times this cell (`off`, `draft`, or `after` at a width) in this bucket:
        that sample prices nothing (the step still counts, `BucketCosts.add_step`). A first forward of a shape pays
        one-off work (weight packing, allocator growth, lazy kernel choice): stop 51's profile timed its first drafted
        width-8 step at batch 1 at 460 ms against ~150 for the later ones, that one sample priced width 8 for good,
        the rule never chose it again, and so it was never corrected. Per cell, not per kind of step: a drafted step
        at a new width still prices the draft once the draft has run, and a match step the verify width a drafted
        step warmed."""
        key = (batch_bucket(batch_size), cell, width)
        if key in self.warmed or planted("warmup_priced"):
            return True
        self.warmed.add(key)
        return False

    # `served=False`: a step the operator forced (the start-up profile's arms, the run-time switch) prices its kind
    # but is no sample of the mix the rule serves, whose median bounds the rule's steps (`reference_seconds`).
    def observe_off(self, batch_size: int, seconds: float, served: bool = True) -> None:
        """A plain step is also a width-1 verify without a draft: it prices T_after(1) as well."""
        costs = self.bucket(batch_size)
        if self._warm(batch_size, "off"):
            costs.off.add(seconds)
            costs.after[0].add(seconds)
        costs.add_step(seconds, served)

    def observe_spec(self, batch_size: int, width: int, draft_s: float, after_s: float, served: bool = True) -> None:
        costs = self.bucket(batch_size)
        if self._warm(batch_size, "draft"):
            costs.draft.add(draft_s)
        if self._warm(batch_size, "after", width):
            costs.after[width - 1].add(after_s)
        costs.add_step(draft_s + after_s, served)

    def observe_match(self, batch_size: int, width: int, after_s: float, served: bool = True) -> None:
        """A match step (no draft pass) prices T_after(width) only."""
        costs = self.bucket(batch_size)
        if self._warm(batch_size, "after", width):
            costs.after[width - 1].add(after_s)
        costs.add_step(after_s, served)

    def spec_seconds(self, batch_size: int) -> list[float] | None:
        """Seconds of a speculative step at each width w = 1 .. W (draft included), or None before it is measured."""
        costs = self.buckets.get(batch_bucket(batch_size))
        if costs is None or costs.draft.value() is None:
            return None
        after = costs.after_seconds()
        if after is None:
            return None
        draft = 0.0 if planted("cost_no_draft") else costs.draft.value()
        return [draft + t for t in after]

    def off_seconds(self, batch_size: int) -> float | None:
        costs = self.buckets.get(batch_bucket(batch_size))
        return None if costs is None else costs.off.value()

    def reference_seconds(self, batch_size: int) -> float | None:
        """The bucket's typical step, which bounds the rule's steps: the median of its recent served steps once it has
        timed `SERVED_MIN`, before that the median of every step it timed (the start-up profile's forced arms), None
        before any. Served steps only, because the profile's arms are half full-width drafted steps: stop 49's bucket 6
        kept a 255 ms median from them against 143 ms served, and let width-7/8 match steps of up to 324 ms (2.2x the
        served median) through. Not a plain step's cost until then (stop 50 tried it): at batch 1 a drafted step costs
        1.5-2x a plain one on a CPU, so that bound forbade the wide drafted steps that make batch 1 fast, the rule
        never drafted, and the served median never left the plain step (accept length 1.03 for a draft giving 2.5)."""
        costs = self.buckets.get(batch_bucket(batch_size))
        if costs is None:
            return None
        return costs.served.value() if len(costs.served.samples) >= SERVED_MIN else costs.step.value()

    def to_dict(self) -> dict:
        return {"width": self.width, "buckets": {str(b): c.to_dict() for b, c in sorted(self.buckets.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        width = int(d["width"])
        return cls(width, {int(b): BucketCosts.from_dict(width, c) for b, c in d["buckets"].items()})


@dataclass
class AcceptStats:
    """Decayed per-position counts of earlier steps (position j = 1 .. gamma): `tested[j]` rows that verified draft j
    having accepted j - 1, `passed[j]` rows that accepted draft j, and for the calibration `predicted[j]` the summed
    confidence survival of the rows that verified draft j and `reached[j]` how many of them accepted it."""

    gamma: int
    # Memory in rows, not steps: each row's weight falls by (1 - 1/memory_rows) per row recorded after it, so a
    # bucket of 16 forgets in 16 steps what a bucket of 1 forgets in 256 (with a per-step decay of 0.995, the served
    # load table's batch-16 cells ran on the previous prompt set's acceptance for most of their ~60 steps).
    memory_rows: float = 256.0
    tested: torch.Tensor = field(init=False)
    passed: torch.Tensor = field(init=False)
    predicted: torch.Tensor = field(init=False)
    reached: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.memory_rows < 1:
            raise ValueError(f"memory_rows must be >= 1, got {self.memory_rows}")
        for name in ("tested", "passed", "predicted", "reached"):
            setattr(self, name, torch.zeros(self.gamma, dtype=torch.float64))

    def record(self, width: int, accepted: torch.Tensor, survival: torch.Tensor | None) -> None:
        """accepted [R] drafts each row accepted with width-w verify (w - 1 drafts verified); survival [R, gamma] the
        confidence head's prediction for this step's rows, if any."""
        c = accepted.detach().to("cpu", torch.float64)[:, None]
        j = torch.arange(1, self.gamma + 1, dtype=torch.float64)[None]
        verified = (j <= width - 1).to(torch.float64)
        keep = (1.0 - 1.0 / self.memory_rows) ** (1 if planted("accept_per_step") else c.shape[0])
        for name in ("tested", "passed", "predicted", "reached"):
            getattr(self, name).mul_(keep)
        self.tested += ((c >= j - 1) * verified).sum(0)
        self.passed += ((c >= j) * verified).sum(0)
        if survival is not None:
            self.predicted += (survival.detach().to("cpu", torch.float64) * verified).sum(0)
            self.reached += ((c >= j) * verified).sum(0)

    def survival(self, prior: float = 0.5, strength: float = 2.0) -> torch.Tensor:
        """P(draft j accepted) for j = 1 .. gamma ([gamma] float64): the products of the per-position pass rates (a
        weak prior where a position was never tested)."""
        return ((self.passed + prior * strength) / (self.tested + strength)).cumprod(0)

    def expected_accepted(self) -> torch.Tensor:
        """E[accepted drafts | width w] for w = 1 .. gamma + 1 ([gamma + 1] float64)."""
        s = self.survival()
        return torch.cat([s.new_zeros(1), s.cumsum(0)])

    def calibration(self, strength: float = 4.0) -> torch.Tensor:
        """Per position, realized / predicted survival ([gamma]; 1 where nothing is known yet)."""
        return (self.reached + strength) / (self.predicted + strength)

    @property
    def samples(self) -> float:
        return float(self.tested[0])


class RequestRates:
    """Each request's draft acceptance relative to its bucket's expectation: realized accepted drafts against the
    bucket's E[accepted | w] at the widths the request verified, as a ratio shrunk towards 1 by `prior` expected
    tokens. The bucket's statistics mix every request it served; a server that moves from prose to code (or serves
    both at once) would otherwise draft for the code rows at the prose rows' rate for hundreds of rows. Bounded: the
    `capacity` most recently seen requests."""

    def __init__(self, prior: float = 2.0, capacity: int = 4096):
        self.prior, self.capacity = prior, capacity
        self._seen: OrderedDict[Hashable, list[float]] = OrderedDict()  # key -> [realized, expected]

    def scale(self, keys: Sequence[Hashable]) -> torch.Tensor:
        """[R] float64: realized / expected of each request (1 for a request with no draft rows yet)."""
        out = [(r + self.prior) / (e + self.prior) for r, e in (self._seen.get(k, (0.0, 0.0)) for k in keys)]
        return torch.tensor(out, dtype=torch.float64)

    def record(self, keys: Sequence[Hashable], accepted: torch.Tensor, expected: torch.Tensor) -> None:
        for k, a, e in zip(keys, accepted.tolist(), expected.tolist(), strict=True):
            acc = self._seen.pop(k, None) or [0.0, 0.0]
            acc[0] += a
            acc[1] += e
            self._seen[k] = acc
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()


@dataclass
class RuleConfig:
    """The full-cost rule's knobs (see `FullCostRule`)."""

    # Speculate when its expected tokens/s beat a plain step's by `margin` (0.10: served step costs here move by
    # +-15 % from minute to minute, and a wrong "on" costs up to 2x an off step where a wrong "off" gives up only the
    # margin) and keep speculating until they fall below 1 + margin - hysteresis.
    margin: float = 0.10
    hysteresis: float = 0.05
    dwell: int = 8  # decisions an off bucket stays off before it may switch on again ...
    dwell_on: int = 2  # ... and an on bucket speculates before it may switch off (asymmetric: see `margin`)
    explore_every: int = 64  # every n-th decision of a bucket runs the other arm once, to keep its cost fresh
    cold_samples: int = 3  # steps of each arm a bucket times before the rule decides (spec first)
    # Drafted steps a server runs (at most) before it prices the draft by its acceptance: until `cold_rows` rows have
    # verified the draft's block, its survival is a prior of 0.5 per position, which a match from the text (the same
    # prior, no draft pass) always beats, so a server with the hybrid on and a loaded cost table would never draft
    # and never learn that its draft pays (stop 47: a draft accepting ~2.5 per step served at 1.03 tokens per step).
    cold_rows: int = 8
    # Verify columns (rows x width) of the rule's steps in a bucket with no costs (`FullCostRule.cold_width`): width
    # max(2, cold_columns // B), at most the whole window (B <= 4 at gamma 7). The whole window at any batch was a
    # 256-column verify at batch 32 (several plain steps on a CPU) on a guess; 2 columns per row cost about two plain
    # steps on a CPU and little more on a GPU, and their timings price the wider widths (`BucketCosts.after_seconds`).
    cold_columns: int = 32
    max_batch: int | None = None  # operator cap: larger batches never speculate
    # No step is priced as a choice when it would take more than this many times the bucket's typical step (the
    # median of its recent served steps, `CostTable.reference_seconds`): a wide verify that pays in tokens/s still
    # holds every row's next token for its whole length (a served bucket-16 table ran width-8 match steps of 390 ms
    # against a 153 ms median). Issue 41's goal is 2x, on realized steps; the rule prices with medians, and a served
    # step runs up to ~20 % over its median (stop 49, bucket 16: steps priced 334-388 ms reached 402 ms, 2.07x), so
    # the bound sits at 1.7 = 2 / 1.2. None: no bound.
    max_step_ratio: float | None = 1.7
    mode: Mode = "auto"  # "on": always speculate (tests, fixed-schedule benchmarks); "off": never; "match": never
    # draft, verify the text's matches where they pay (a draft not trained yet, or not worth its pass on this box)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; expected one of {MODES}")
        if (self.margin < 0 or self.hysteresis < 0 or min(self.dwell, self.dwell_on) < 1 or self.explore_every < 0
                or min(self.cold_samples, self.cold_rows) < 0 or self.cold_columns < 2
                or (self.max_step_ratio is not None and self.max_step_ratio < 1)):
            raise ValueError(f"bad rule settings {self}")


@dataclass
class Decision:
    speculate: bool
    why: str  # "rule", "cold" (costs unmeasured), "learn" (acceptance unmeasured), "explore", "cap", "forced"
    predicted: float = 0.0  # expected tokens per request of the step (1 + E[accepted]); 1 when off


@dataclass
class _BucketState:
    on: bool | None = None  # None until the rule first prices both arms: then it takes the rule's choice at once
    since: int = 0  # decisions since the last switch
    decisions: int = 0
    why: Counter = field(default_factory=Counter)  # speculative steps by reason ("rule", "cold", "explore", ...)
    turned_on: int = 0  # times the rule switched the bucket from off to on

    @property
    def speculated(self) -> int:
        return sum(self.why.values())


@dataclass
class FullCostRule:
    """Speculate or not (before drafting) and how wide (after drafting), by one full-cost objective; shared by the
    reference engine and the SGLang worker. Integration:

        d = rule.decide(B)                            # earlier steps' data only
        if d.speculate:
            draft ...; lengths = rule.widths(survival_factors)      # [R, gamma] per-request survival factors, any
            verify/accept ...                                        # proposal (DSpark head, n-gram, ...)
            rule.observe_spec(B, width, draft_s, after_s, accepted, survival)
        else:
            plain step ...; rule.observe_off(B, seconds)

    `widths` takes per-request conditional survival factors c[r, j] (survival = cumprod); a proposer without a
    confidence head passes its own (e.g. a constant per position): the calibration learns the rest."""

    gamma: int
    costs: CostTable | None = None
    config: RuleConfig = field(default_factory=RuleConfig)
    learn_costs: bool = True  # False: the table is fixed (tests, a trusted offline profile)
    accept: dict[int, AcceptStats] = field(default_factory=dict)
    requests: RequestRates = field(default_factory=RequestRates)
    overall: AcceptStats = field(init=False)
    _state: dict[int, _BucketState] = field(default_factory=dict, init=False, repr=False)
    _cold_drafts: int = field(default=0, init=False, repr=False)  # drafted steps taken for want of acceptance data

    def __post_init__(self) -> None:
        self.costs = self.costs or CostTable(self.gamma + 1)
        if self.costs.width != self.gamma + 1:
            raise ValueError(f"cost table width {self.costs.width} but the verify window is {self.gamma + 1}")
        self.overall = AcceptStats(self.gamma)

    def forget_acceptance(self) -> None:
        """A new draft (a live update): its acceptance is learnt again, per bucket and per request; its costs stay."""
        self.accept.clear()
        self.requests.clear()
        self.overall = AcceptStats(self.gamma)
        self._cold_drafts = 0

    # -- before drafting ---------------------------------------------------------------------------------------
    def rates(self, batch_size: int, match: torch.Tensor | None = None, keys: Sequence[Hashable] | None = None
              ) -> tuple[list[float], float] | None:
        """(expected tokens/s of a speculative step at each width w = 1 .. W, tokens/s of the best step without a
        draft pass), or None while either arm of the bucket is unmeasured. `match` [B, gamma]: the survival of each
        row's match from its own text (the hybrid; 0 where none). With it, a drafted step's row verifies whichever
        of the draft's block and the match is expected to commit more (as `MatchChooser.choose` will), and the step
        without a draft pass is the better of a plain step and a match step (`match_width`): drafting must beat what
        the text gives for free. `keys` (one per row: the requests): each row's draft survival is the bucket's scaled
        by its request's realized / expected acceptance so far (`RequestRates`)."""
        spec_s, off_s = self.costs.spec_seconds(batch_size), self.costs.off_seconds(batch_size)
        if spec_s is None or off_s is None:
            return None
        draft = self._stats(batch_size).survival()[None].expand(batch_size, -1)
        if keys is not None and not planted("request_blind"):
            draft = (draft * self.requests.scale(keys)[:, None]).clamp(0.0, 1.0).cummin(1).values
        rows, alternative = draft, batch_size / off_s
        if match is not None and match.numel():
            m = match.detach().to(torch.float64).cpu().clamp(0.0, 1.0)
            rows = torch.where((m.sum(1) > draft.sum(1))[:, None], m, draft)
            alternative = max(alternative, self._match_rate(batch_size, m)[0])
        seconds = torch.tensor(spec_s, dtype=torch.float64)
        spec = torch.where(self._within(batch_size, seconds), self._tokens(batch_size, rows) / seconds, 0.0)
        return spec.tolist(), alternative

    @staticmethod
    def _tokens(batch_size: int, survival: torch.Tensor) -> torch.Tensor:
        """Expected committed tokens of a step at widths 1 .. gamma + 1 from the rows' survival [B, gamma]."""
        return batch_size + torch.cat([survival.new_zeros(1), survival.sum(0).cumsum(0)])

    def _match_rate(self, batch_size: int, survival: torch.Tensor) -> tuple[float, int]:
        """(tokens/s, width) of the best match step (no draft pass: T_after(w)); (0, 1) while its costs are unknown."""
        costs = self.costs.buckets.get(batch_bucket(batch_size))
        after = None if costs is None else costs.after_seconds()
        if after is None or not survival.numel():
            return 0.0, 1
        seconds = torch.tensor(after, dtype=torch.float64)
        rates = torch.where(self._within(batch_size, seconds), self._tokens(batch_size, survival) / seconds, 0.0)
        w = int(rates.argmax()) + 1
        return float(rates[w - 1]), w

    def _within(self, batch_size: int, seconds: torch.Tensor) -> torch.Tensor:
        """[W] bool: the widths whose step stays within `max_step_ratio` x the bucket's typical step (all while the
        bucket has timed none)."""
        ratio = self.config.max_step_ratio
        typical = None if ratio is None or planted("step_uncapped") else self.costs.reference_seconds(batch_size)
        if typical is None:
            return torch.ones(seconds.shape, dtype=torch.bool, device=seconds.device)
        return seconds <= ratio * typical

    def decide(self, batch_size: int, match: torch.Tensor | None = None, keys: Sequence[Hashable] | None = None
               ) -> Decision:
        """Speculate this step or not, from earlier steps' data only (costs, acceptance, this bucket's counters, the
        rows' requests' acceptance so far when `keys` names them) and, with the hybrid, the survival [B, gamma] of
        the rows' matches (a function of the committed text)."""
        st = self._state.setdefault(batch_bucket(batch_size), _BucketState())
        st.decisions += 1
        decision = self._decide(batch_size, st, match, keys)
        if decision.speculate:
            st.why[decision.why] += 1
        return decision

    def _decide(self, batch_size: int, st: _BucketState, match: torch.Tensor | None = None,
                keys: Sequence[Hashable] | None = None) -> Decision:
        cfg = self.config
        if cfg.mode == "off" or (cfg.max_batch is not None and batch_size > cfg.max_batch):
            return Decision(False, "cap" if cfg.mode in ("auto", "match") else "forced", 1.0)
        if cfg.mode == "match":
            return Decision(False, "mode", 1.0)
        if cfg.mode == "on":
            return Decision(True, "forced", self._predicted(batch_size))
        costs = self.costs.buckets.get(batch_bucket(batch_size))
        if costs is None or costs.draft.seen < cfg.cold_samples:
            return Decision(True, "cold", self._predicted(batch_size))
        if costs.off.seen < cfg.cold_samples:
            return Decision(False, "cold", 1.0)
        if (self.overall.samples < cfg.cold_rows and self._cold_drafts < cfg.cold_rows
                and not planted("accept_cold")):
            self._cold_drafts += 1
            return Decision(True, "learn", self._predicted(batch_size))
        rates = self.rates(batch_size, None if planted("match_blind_decide") else match, keys)
        if rates is not None:
            ratio = max(rates[0]) / rates[1]
            want = ratio > 1 + cfg.margin - (cfg.hysteresis if st.on else 0.0)
            if st.on is None or (want != st.on and st.since >= (cfg.dwell_on if st.on else cfg.dwell)):
                st.turned_on += want and st.on is False
                st.on, st.since = want, 0
        st.since += 1
        arm, why = bool(st.on), "rule"
        if cfg.explore_every and st.decisions % cfg.explore_every == 0:
            arm, why = not arm, "explore"
        return Decision(arm, why, self._predicted(batch_size) if arm else 1.0)

    def match_width(self, batch_size: int, survival: torch.Tensor) -> int:
        """The width of a match step, or 1 (an off step). Asked where `decide` said off: the rows' matches from their
        own text (speculative/match.py) cost no draft pass, so a width-w step that verifies only them costs T_after(w)
        and is expected to commit B + sum_{j<w} survival[:, j - 1] tokens. The widest-paying w is taken when it beats a
        plain step's B / T_off by the margin. `survival` [B, gamma] (0 on rows without a match) is a function of the
        committed text and earlier steps' outcomes only, so the choice is lossless like `decide`'s. The operator's
        mode "off" and batch cap forbid match steps as they forbid drafting. Cold start: until the bucket has timed
        `cold_samples` steps wider than 1, a step with any match runs at its longest match's width up to `cold_width`
        (a verify width nobody measured is priced as w plain steps, which would never let the first one run)."""
        cfg = self.config
        if cfg.mode == "off" or (cfg.max_batch is not None and batch_size > cfg.max_batch) or not survival.numel():
            return 1
        s = survival.detach().to(torch.float64).cpu().clamp(0.0, 1.0)
        costs = self.costs.buckets.get(batch_bucket(batch_size))
        if costs is None or sum(c.seen for c in costs.after[1:]) < cfg.cold_samples:
            cols = s.sum(0).nonzero()
            return min(int(cols.max()) + 2, self.cold_width(batch_size)) if cols.numel() else 1
        off_s = self.costs.off_seconds(batch_size)
        rate, w = self._match_rate(batch_size, s)
        return w if off_s is not None and rate > (1 + cfg.margin) * batch_size / off_s else 1

    # -- after drafting ----------------------------------------------------------------------------------------
    def widths(self, conf: torch.Tensor, bounded: bool = True) -> torch.Tensor:
        """Verify lengths [R] (one width for all rows: a padded verify) from this step's survival factors conf
        [R, gamma], priced at the full cost. Until the bucket's costs are measured: the whole window. `bounded=False`:
        no step-length bound (`max_step_ratio`): the operator forced speculation (the run-time switch, the start-up
        profile's drafted arm), which asks for widths, not for the rule's latency guard (a bucket that had served
        off steps bounded forced steps to width 1: the forced hybrid served test verified nothing). Until the bucket's
        draft and verify are priced: `cold_width` (a forced step: the whole window)."""
        _check_conf(conf)
        num_requests, gamma = conf.shape
        spec_s = self.costs.spec_seconds(num_requests)
        if spec_s is None or conf.numel() == 0:
            cold = self.cold_width(num_requests) if bounded else gamma + 1
            return static_verify_lengths(num_requests, cold - 1, conf.device)
        survival = self.calibrated_survival(conf)
        seconds = torch.tensor(spec_s, dtype=torch.float64, device=conf.device)
        within = self._within(num_requests, seconds) if bounded else torch.ones_like(seconds, dtype=torch.bool)
        rate = torch.where(within, 1.0 / seconds, 0.0)  # a width past the bound: never
        if planted("decide_peek"):  # turns speculation off after reading this step's drafts' survivals
            off_s = self.costs.off_seconds(num_requests)
            tau = num_requests + torch.cat([survival.new_zeros(1), survival.sum(0).cumsum(0)])
            if off_s is not None and float((tau * rate).max()) <= num_requests / off_s:
                return torch.ones(num_requests, dtype=torch.long, device=conf.device)
        columns = padded_columns(survival.sum(0), num_requests, rate)
        return (columns + 1).expand(num_requests).clone()

    def cold_width(self, batch_size: int) -> int:
        """The verify width of the rule's steps in a bucket with no costs: the whole window up to
        `RuleConfig.cold_columns` columns in all, never below 2 (batch 1-4: 8; 8: 4; 16 and up: 2, at gamma 7)."""
        if planted("cold_wide"):
            return self.gamma + 1
        return max(2, min(self.gamma + 1, self.config.cold_columns // max(int(batch_size), 1)))

    def calibrated_survival(self, conf: torch.Tensor) -> torch.Tensor:
        """Survival [R, gamma] = cumprod(conf) x the running realized/predicted ratio per position, kept non-increasing
        along the row (column j reads columns <= j only)."""
        c = conf.detach().to(torch.float64).nan_to_num(0.0).clamp(0.0, 1.0)
        factor = self._stats(conf.shape[0]).calibration().to(c.device)
        return (c.cumprod(1) * factor).clamp(0.0, 1.0).cummin(1).values

    # -- after the step ----------------------------------------------------------------------------------------
    # `served=False`: a step the operator forced (see `CostTable.observe_off`)
    def observe_off(self, batch_size: int, seconds: float, served: bool = True) -> None:
        if self.learn_costs:
            self.costs.observe_off(batch_size, seconds, served)

    def observe_spec(self, batch_size: int, width: int, draft_s: float | None, after_s: float | None,
                     accepted: torch.Tensor, conf: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                     keys: Sequence[Hashable] | None = None) -> None:
        """One speculative step: its timings (None: not known yet, e.g. CUDA events still running: the worker passes
        them later to `observe_spec_costs`), the accepted drafts per row and the raw survival factors it was scheduled
        with (`rows`: those that verified the draft's block, see `observe_accept`)."""
        if draft_s is not None and after_s is not None:
            self.observe_spec_costs(batch_size, width, draft_s, after_s)
        self.observe_accept(batch_size, width, accepted, conf, rows, keys)

    def observe_spec_costs(self, batch_size: int, width: int, draft_s: float, after_s: float,
                           served: bool = True) -> None:
        if self.learn_costs:
            self.costs.observe_spec(batch_size, width, draft_s, after_s, served)

    def observe_match(self, batch_size: int, width: int, after_s: float, served: bool = True) -> None:
        """A match step's timing (its acceptance is the matcher's to learn, never the draft's statistics)."""
        if self.learn_costs:
            self.costs.observe_match(batch_size, width, after_s, served)

    def observe_accept(self, batch_size: int, width: int, accepted: torch.Tensor,
                       conf: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                       keys: Sequence[Hashable] | None = None) -> None:
        """The draft's acceptance at this step: `rows` [R] bool (host) selects the rows that verified the draft's block
        (the hybrid's match rows are the matcher's to learn: `draft_rows`); None: every row. `keys` [R]: the rows'
        requests, whose realized / expected ratios (`RequestRates`) the decision reads."""
        if rows is not None:
            accepted, conf = accepted[rows.to(accepted.device)], None if conf is None else conf[rows.to(conf.device)]
            keys = None if keys is None else [k for k, r in zip(keys, rows.tolist(), strict=True) if r]
            if not accepted.numel():
                return
        if keys is not None:
            expected = self._stats(batch_size).expected_accepted()[width - 1]
            self.requests.record(keys, accepted.detach().to("cpu", torch.float64), expected.expand(len(keys)))
        survival = None
        if conf is not None and conf.numel():
            survival = conf.detach().to(torch.float64).nan_to_num(0.0).clamp(0.0, 1.0).cumprod(1)
        for stats in (self.overall, self.accept.setdefault(batch_bucket(batch_size), AcceptStats(self.gamma))):
            stats.record(width, accepted, survival)

    def info(self) -> dict:
        """Per bucket: predicted rates, the state, and the costs (what /server_info shows)."""
        out = {}
        for b in sorted(set(self.costs.buckets) | set(self._state)):
            rates = self.rates(b)
            st = self._state.get(b, _BucketState())
            spec_s, off_s = self.costs.spec_seconds(b), self.costs.off_seconds(b)
            out[str(b)] = {
                "on": st.on, "decisions": st.decisions, "speculated": st.speculated,
                "speculated_why": dict(st.why), "turned_on": st.turned_on,
                "spec_ms_by_width": None if spec_s is None else [round(s * 1e3, 3) for s in spec_s],
                "off_ms": None if off_s is None else round(off_s * 1e3, 3),
                "best_spec_over_off": None if rates is None else round(max(rates[0]) / rates[1], 4),
                "expected_accepted_by_width": [round(float(x), 4) for x in self._stats(b).expected_accepted()],
            }
        return out

    def _stats(self, batch_size: int) -> AcceptStats:
        """The bucket's acceptance once it has 16 tested rows, else the server's overall."""
        stats = self.accept.get(batch_bucket(batch_size))
        return stats if stats is not None and stats.samples >= 16 else self.overall

    def _predicted(self, batch_size: int) -> float:
        """Expected tokens per request of a speculative step at the width the rates favour (full window if unknown)."""
        expected = self._stats(batch_size).expected_accepted()
        rates = self.rates(batch_size)
        w = self.gamma + 1 if rates is None else max(range(len(rates[0])), key=rates[0].__getitem__) + 1
        return 1.0 + float(expected[w - 1])


@dataclass
class AdaptivePlanner:
    """The reference engine's full-cost planner: `decide` before drafting, then Proposal -> verify lengths [B] (STS
    temperatures on the confidence logits, then `FullCostRule.widths`). A draft without a confidence head verifies the
    whole window when it speculates."""

    rule: FullCostRule
    temperatures: torch.Tensor | None = None

    def decide(self, batch_size: int, match: torch.Tensor | None = None, keys: Sequence[Hashable] | None = None
               ) -> Decision:
        return self.rule.decide(batch_size, match, keys)

    def survival_factors(self, proposal: Proposal) -> torch.Tensor | None:
        return None if proposal.conf_logits is None else self.calibrated(proposal.conf_logits)

    def calibrated(self, conf_logits: torch.Tensor) -> torch.Tensor:
        """The STS-calibrated confidences [B, γ] of raw confidence logits."""
        temps = None if self.temperatures is None else torch.as_tensor(self.temperatures, device=conf_logits.device)
        return apply_sts(conf_logits.float(), temps)

    def from_conf(self, conf: torch.Tensor) -> torch.Tensor:
        """Verify lengths from survival factors of any proposer (the hybrid's rows: match.py)."""
        return self.rule.widths(conf)

    def __call__(self, proposal: Proposal) -> torch.Tensor:
        conf = self.survival_factors(proposal)
        if conf is None:
            return static_verify_lengths(*proposal.tokens.shape, proposal.tokens.device)
        return self.from_conf(conf)
