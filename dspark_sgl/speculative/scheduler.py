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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.sts import apply_sts

if TYPE_CHECKING:
    from dspark_sgl.speculative.markov import Proposal

Policy = Literal["static", "confidence"]
POLICIES: tuple[str, ...] = ("static", "confidence")


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
    dev = conf.device
    if conf.numel() == 0:
        return torch.ones(num_requests, dtype=torch.long, device=dev)
    c = conf.detach().to(torch.float64).nan_to_num(0.0).clamp(0.0, 1.0)
    column = c.cumprod(dim=1).sum(dim=0)  # A_d: expected accepted drafts in column d, non-increasing in d
    tau = torch.cat([column.new_zeros(1), column.cumsum(0)]) + num_requests  # tau_d with d columns, d = 0..gamma
    d = torch.arange(gamma + 1, device=dev)
    theta = tau * sps.lookup(num_requests * (d + 1))  # Theta_d
    m = d[None, 1:]  # wider windows m = d+1 .. gamma
    bound = (tau[:gamma, None] + (m - d[:gamma, None]) * column[:, None]) * sps.lookup(num_requests * (m + 1))
    bound = bound.masked_fill(m <= d[:gamma, None], float("-inf")).amax(dim=1)
    admitted = (bound > theta[:gamma]).long().cumprod(0).sum()
    return (admitted + 1).expand(num_requests).clone()


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
