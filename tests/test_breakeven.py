"""The a/(d+T) break-even arithmetic reproduces card 000's figures."""

from __future__ import annotations

import math

import pytest
import typer
from typer.testing import CliRunner

from dspark_sgl.tools.breakeven import breakeven, describe, speed_factor
from dspark_sgl.tools.cli_tools import register


def test_card_000_numbers():
    b = breakeven(5.70, 3.29, 0.81, 0.14)
    assert round(b.acceptance_ratio, 3) == 0.577
    assert round(b.required_speedup, 2) == 1.73  # "NVFP4 must win 1.73× on the draft pass merely to break even"
    assert round(b.max_speedup, 2) == 1.23  # "tops out at 1.23 — below 1.73 even in the limit"
    assert math.isinf(b.break_even_d_over_t)  # no d/T can pay for it when ρ < r
    assert round(b.speedup_at, 2) == 1.02 and b.throughput_ratio_at < 0.6 and not b.pays_off
    generous = breakeven(5.70, 3.29, 0.5)  # native FP4 tensor cores: d_nvfp4 ≈ 0.5·d_fp8
    assert round(generous.break_even_d_over_t, 1) == 5.5  # "would require d_fp8 ≥ 5.5·T"
    assert generous.speedup_at is None and generous.throughput_ratio_at is None


def test_break_even_point_is_where_throughput_ratio_is_one():
    b = breakeven(4.0, 3.5, 0.6)
    x = b.break_even_d_over_t
    assert b.acceptance_ratio * speed_factor(x, 0.6) == pytest.approx(1.0, abs=1e-12)
    assert breakeven(4.0, 3.5, 0.6, x * 1.1).pays_off and not breakeven(4.0, 3.5, 0.6, x * 0.9).pays_off
    assert breakeven(4.0, 4.4, 1.0).break_even_d_over_t == 0.0  # better acceptance pays off at any cost ratio


@pytest.mark.parametrize(
    "args",
    [
        (0, 3.0, 0.8, None),
        (5.0, -1.0, 0.8, None),
        (5.0, 3.0, 0.0, None),
        (5.0, 3.0, 0.8, -0.1),
        (math.nan, 3.0, 0.8, None),
    ],
)
def test_bad_input_is_one_clear_error(args):
    with pytest.raises(ValueError, match="must be a"):
        breakeven(*args)


def test_cli_prints_the_card_figures():
    app = typer.Typer()
    register(app)
    res = CliRunner().invoke(
        app,
        ["breakeven", "--a-ref", "5.70", "--a-cand", "3.29", "--d-ratio", "0.81", "--d-over-t", "0.14"],
        terminal_width=200,
    )
    assert res.exit_code == 0, res.output
    assert "1.73×" in res.output and "1.23×" in res.output and "does not pay off" in res.output
    rows = dict(describe(breakeven(5.70, 3.29, 0.81, 0.14)))
    assert rows["break-even needs d_ref/T ≥"] == "never"
    bad = CliRunner().invoke(app, ["breakeven", "--a-ref", "5.7", "--a-cand", "0", "--d-ratio", "0.8"])
    assert bad.exit_code == 2 and "a_cand must be a positive number" in bad.output
