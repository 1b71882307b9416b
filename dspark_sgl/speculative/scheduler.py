"""Hardware-aware prefix scheduler (DSpark Algorithm 1): how many draft tokens each request verifies.

Survival a[r, j] = prod_{i<=j} c[r, i] is the chance draft j of request r is accepted. Candidates (r, j)
are admitted in descending a; with k admitted the step is expected to commit tau_k = R + sum of their a
(one bonus token per request) at SPS(R + k) steps/s, so throughput is Theta_k = tau_k * SPS(R + k).
Admission stops at the FIRST k whose Theta does not beat Theta_{k-1}. That early stop is what keeps
speculative sampling exact: whether (r, j) is admitted then depends only on candidates ranked above it,
i.e. on c[r, <=j] (functions of x[r, <j]) and on other requests, never on the draft token x[r, j] being
tested. Taking the argmax of Theta over all k instead "peeks" at a[r, j+1], which depends on x[r, j],
and biases the output (tests/test_scheduler.py shows it).

Everything is vectorised torch on the confidences' device, O(R*gamma*log(R*gamma)), with no host sync.
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


def first_non_improvement(theta: torch.Tensor) -> torch.Tensor:
    """Number of candidates admitted: the length of the leading run of strict improvements (0-dim long)."""
    improves = (theta[1:] > theta[:-1]).long()
    return improves.cumprod(0).sum()


def lengths_from_admitted(
    request_ids: torch.Tensor, num_admitted: torch.Tensor, num_requests: int
) -> torch.Tensor:
    """Per-request verify length = 1 (anchor) + its candidates among the first num_admitted ranked."""
    admitted = (torch.arange(request_ids.numel(), device=request_ids.device) < num_admitted).long()
    counts = torch.zeros(num_requests, dtype=torch.long, device=request_ids.device)
    return counts.scatter_add_(0, request_ids, admitted) + 1


def confidence_verify_lengths(conf: torch.Tensor, sps: SpsTable) -> torch.Tensor:
    """Algorithm 1. conf [R, gamma] (calibrated per-position confidences) -> verify lengths [R] long in
    [1, gamma + 1], on conf's device."""
    _check_conf(conf)
    num_requests = conf.shape[0]
    if conf.numel() == 0:
        return torch.ones(num_requests, dtype=torch.long, device=conf.device)
    a_sorted, request_ids, _ = rank_candidates(conf)
    theta = throughput_curve(a_sorted, num_requests, sps)
    return lengths_from_admitted(request_ids, first_non_improvement(theta), num_requests)


def static_verify_lengths(
    num_requests: int, gamma: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Everyone verifies the full window: anchor + gamma drafts."""
    return torch.full((num_requests,), gamma + 1, dtype=torch.long, device=device)


def schedule(conf: torch.Tensor, sps: SpsTable | None, policy: Policy = "confidence") -> torch.Tensor:
    """The engines' one call: verify lengths [R] for this step under the given policy."""
    _check_conf(conf)
    if policy == "static":
        return static_verify_lengths(conf.shape[0], conf.shape[1], conf.device)
    if policy == "confidence":
        if sps is None:
            raise ValueError("the 'confidence' schedule needs an SPS table (profile one or load a JSON)")
        return confidence_verify_lengths(conf, sps)
    raise ValueError(f"unknown schedule policy {policy!r}; expected one of {POLICIES}")


@dataclass
class ConfidencePlanner:
    """The reference engine's planner: Proposal -> verify lengths [B]. Applies the STS temperatures to the
    raw confidence logits, then schedules. Engines that lag confidences call `schedule` directly."""

    sps: SpsTable | None
    temperatures: torch.Tensor | None = None
    policy: Policy = "confidence"
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
        logits = proposal.conf_logits.float()
        return confidence_verify_lengths(apply_sts(logits, self._temperatures(logits.device)), self.sps)

    def _temperatures(self, device: torch.device) -> torch.Tensor | None:
        # Cached per device: a fresh host->device copy every step would be a sync point.
        if self.temperatures is None:
            return None
        key = str(device)
        if key not in self._temps_on:
            self._temps_on[key] = torch.as_tensor(self.temperatures, dtype=torch.float32, device=device)
        return self._temps_on[key]
