"""Speculative break-even arithmetic (card 000): is a cheaper, less accurate draft worth it? Decide first.

Throughput goes as a / (d + T): accepted tokens per step over draft-pass plus target-verify cost. Swapping a
reference draft (acceptance a_ref, cost d) for a candidate (a_cand, cost r·d) changes throughput by

    ratio(x) = (a_cand / a_ref) · (x + 1) / (r·x + 1),        x = d / T

The acceptance factor ρ = a_cand/a_ref is fixed; the speed factor (x+1)/(r·x+1) grows with x towards 1/r. So
the candidate must speed the draft pass up by 1/ρ just to break even, can never gain more than 1/r however
draft-dominated the step is, and breaks even only when x ≥ (1-ρ)/(ρ-r), which needs ρ > r.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BreakEven:
    a_ref: float
    a_cand: float
    d_ratio: float  # r = d_cand / d_ref
    d_over_t: float | None  # x = d_ref / T, if known
    acceptance_ratio: float  # ρ
    required_speedup: float  # 1/ρ: the draft-pass speed factor needed to break even
    max_speedup: float  # lim_{x→∞} (x+1)/(r x+1) = 1/r
    break_even_d_over_t: float  # smallest x with ratio ≥ 1 (inf: never)
    speedup_at: float | None  # (x+1)/(r x+1) at the given x
    throughput_ratio_at: float | None  # ρ · speedup_at

    @property
    def pays_off(self) -> bool:
        return self.throughput_ratio_at is not None and self.throughput_ratio_at > 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "pays_off_at_d_over_t": self.pays_off if self.d_over_t is not None else None}


def speed_factor(d_over_t: float, d_ratio: float) -> float:
    return (d_over_t + 1.0) / (d_ratio * d_over_t + 1.0)


def breakeven(a_ref: float, a_cand: float, d_ratio: float, d_over_t: float | None = None) -> BreakEven:
    for name, v in (("a_ref", a_ref), ("a_cand", a_cand), ("d_ratio", d_ratio)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive number, got {v}")
    if d_over_t is not None and not (math.isfinite(d_over_t) and d_over_t >= 0):
        raise ValueError(f"d_over_t must be a non-negative number, got {d_over_t}")
    rho = a_cand / a_ref
    if rho >= 1:
        x_star = 0.0  # no acceptance loss: any speed-up (or none) already breaks even
    elif rho > d_ratio:
        x_star = (1 - rho) / (rho - d_ratio)
    else:
        x_star = math.inf
    at = None if d_over_t is None else speed_factor(d_over_t, d_ratio)
    return BreakEven(
        a_ref=a_ref,
        a_cand=a_cand,
        d_ratio=d_ratio,
        d_over_t=d_over_t,
        acceptance_ratio=rho,
        required_speedup=1 / rho,
        max_speedup=1 / d_ratio,
        break_even_d_over_t=x_star,
        speedup_at=at,
        throughput_ratio_at=None if at is None else rho * at,
    )


def describe(b: BreakEven) -> list[tuple[str, str]]:
    """(quantity, value) rows in the card's words."""
    rows = [
        ("acceptance ratio a_cand/a_ref", f"{b.acceptance_ratio:.3f}"),
        ("draft-pass speed-up needed to break even", f"{b.required_speedup:.2f}×"),
        (f"best possible speed-up (d/T → ∞, d_cand = {b.d_ratio:g}·d_ref)", f"{b.max_speedup:.2f}×"),
        (
            "break-even needs d_ref/T ≥",
            "never" if math.isinf(b.break_even_d_over_t) else f"{b.break_even_d_over_t:.2f}",
        ),
    ]
    if b.d_over_t is not None:
        rows += [
            (f"draft speed-up at d/T = {b.d_over_t:g}", f"{b.speedup_at:.3f}×"),
            (f"throughput vs reference at d/T = {b.d_over_t:g}", f"{b.throughput_ratio_at:.3f}×"),
        ]
    verdict = "pays off" if b.pays_off else "does not pay off"
    if b.d_over_t is None:
        verdict = "can pay off for large enough d/T" if math.isfinite(b.break_even_d_over_t) else "never pays off"
    rows.append(("verdict", verdict))
    return rows
