"""Sequential Temperature Scaling (STS) for the confidence head, and the calibration metrics.

The scheduler consumes survival S_k = prod_{i<=k} sigmoid(z_i / T_i), read as P(at least k drafts are
accepted). Calibrating each c_k on its own does not make that product calibrated, so STS fits T_k left to
right: with T_1..T_{k-1} fixed, T_k is the grid value that minimises the ECE of S_k against 1[L >= k],
where L is the number of drafts the target accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_GRID = torch.logspace(torch.log10(torch.tensor(0.05)), torch.log10(torch.tensor(20.0)), 241)


def _check_pairs(logits: torch.Tensor, accepted: torch.Tensor) -> None:
    if logits.dim() != 2 or accepted.dim() != 1 or logits.shape[0] != accepted.shape[0]:
        raise ValueError(
            f"expected confidence logits [N, gamma] and accepted lengths [N], got "
            f"{tuple(logits.shape)} and {tuple(accepted.shape)}"
        )
    if logits.shape[0] == 0:
        raise ValueError("no calibration samples")


def survival_labels(accepted: torch.Tensor, gamma: int) -> torch.Tensor:
    """Label [N, gamma]: column k-1 is 1[L >= k], i.e. draft k was accepted."""
    positions = torch.arange(1, gamma + 1, device=accepted.device)
    return (accepted[:, None] >= positions).to(torch.float64)


def apply_sts(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """Calibrated confidences sigmoid(z / T) (per position along the last dim); T=None means identity."""
    if temperatures is None:
        return torch.sigmoid(logits)
    t = torch.as_tensor(temperatures, dtype=logits.dtype, device=logits.device)
    if t.shape != logits.shape[-1:]:
        raise ValueError(f"{t.numel()} temperatures for {logits.shape[-1]} positions")
    return torch.sigmoid(logits / t)


def survival(conf: torch.Tensor) -> torch.Tensor:
    return conf.cumprod(dim=-1)


def _bin_index(prob: torch.Tensor, n_bins: int) -> torch.Tensor:
    return (prob * n_bins).long().clamp(0, n_bins - 1)


def ece(prob: torch.Tensor, label: torch.Tensor, n_bins: int = 15) -> torch.Tensor:
    """Expected calibration error with equal-width bins, along the last dim (batched over leading dims):
    sum over bins of |sum(prob - label)| / N."""
    prob = prob.to(torch.float64)
    gap = prob - label.to(torch.float64).expand_as(prob)
    per_bin = torch.zeros(*prob.shape[:-1], n_bins, dtype=torch.float64, device=prob.device)
    per_bin.scatter_add_(-1, _bin_index(prob, n_bins), gap)
    return per_bin.abs().sum(-1) / prob.shape[-1]


def brier(prob: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((prob.to(torch.float64) - label.to(torch.float64)) ** 2).mean(-1)


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties given their average rank."""
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    return ((ends - counts + 1 + ends) / 2)[inverse]


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Rank-based AUROC (Mann-Whitney U, ties count 1/2); NaN when only one class is present."""
    pos = label.to(torch.bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(score.to(torch.float64))
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def fit_sts(
    logits: torch.Tensor, accepted: torch.Tensor, grid: torch.Tensor | None = None, n_bins: int = 15
) -> torch.Tensor:
    """Per-position temperatures [gamma] (float64), fitted left to right by grid search on ECE of the
    cumulative product. Among equally good grid values the one closest to T=1 wins."""
    _check_pairs(logits, accepted)
    grid = (DEFAULT_GRID if grid is None else grid).to(torch.float64).to(logits.device)
    if grid.dim() != 1 or grid.numel() == 0 or bool((grid <= 0).any()):
        raise ValueError("the temperature grid must be a non-empty 1-D tensor of positive values")
    z = logits.to(torch.float64)
    labels = survival_labels(accepted, z.shape[1])
    prefix = torch.ones(z.shape[0], dtype=torch.float64, device=z.device)
    temps = []
    for k in range(z.shape[1]):
        candidates = prefix * torch.sigmoid(z[:, k] / grid[:, None])  # [G, N]
        err = ece(candidates, labels[:, k], n_bins)
        best = err <= err.min() + 1e-12
        pick = torch.where(best, grid.log().abs(), torch.inf).argmin()
        temps.append(grid[pick])
        prefix = candidates[pick]
    return torch.stack(temps)


def calibration_report(
    logits: torch.Tensor, accepted: torch.Tensor, temperatures: torch.Tensor | None = None, n_bins: int = 15
) -> dict[str, list[float]]:
    """Per-position ECE, AUROC and Brier of survival against 1[L >= k], plus the label rate."""
    _check_pairs(logits, accepted)
    s = survival(apply_sts(logits.to(torch.float64), temperatures))
    labels = survival_labels(accepted, logits.shape[1])
    return {
        "ece": ece(s.t(), labels.t(), n_bins).tolist(),
        "auroc": [auroc(s[:, k], labels[:, k]) for k in range(s.shape[1])],
        "brier": brier(s.t(), labels.t()).tolist(),
        "accept_rate": labels.mean(0).tolist(),
    }


def save_sts(path: str | Path, temperatures: torch.Tensor, report: dict | None = None) -> None:
    """Write {"temperatures": [...], ...}; the draft folder keeps it as sts.json."""
    payload: dict = {"temperatures": [float(t) for t in torch.as_tensor(temperatures).tolist()]}
    if report is not None:
        payload["report"] = report
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def load_sts(path: str | Path, gamma: int | None = None) -> torch.Tensor:
    """Temperatures [gamma] from a file written by save_sts (a bare JSON list is accepted too)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"STS file not found: {file}")
    data = json.loads(file.read_text())
    temps = data.get("temperatures") if isinstance(data, dict) else data
    if (
        not isinstance(temps, list)
        or not temps
        or not all(isinstance(t, int | float) and t > 0 for t in temps)
    ):
        raise ValueError(f"{file}: expected a non-empty list of positive temperatures")
    if gamma is not None and len(temps) != gamma:
        raise ValueError(f"{file}: {len(temps)} temperatures, but the draft has gamma={gamma}")
    return torch.tensor(temps, dtype=torch.float64)
