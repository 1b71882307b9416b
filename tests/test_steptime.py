"""The worker's per-phase decode-step clock (dspark_sgl/sglang/steptime.py): means per phase, incomplete steps."""

import time

import pytest

from dspark_sgl.sglang.steptime import PHASES, StepTimes


def run_step(times: StepTimes, slow: str | None = None, upto: int = len(PHASES)) -> None:
    times.start()
    for phase in PHASES[:upto]:
        if phase == slow:
            time.sleep(0.02)
        times.mark(phase)


def test_means_per_phase_show_where_the_time_went():
    times = StepTimes("cpu")
    run_step(times, slow="verify")
    run_step(times, slow="draft")
    info = times.info()
    assert info["decode_steps_timed"] == 2
    ms = info["ms_per_step"]
    assert set(ms) == set(PHASES)
    assert ms["verify"] >= 10 and ms["draft"] >= 10  # 20 ms in one of two steps each
    assert ms["accept"] < 5
    assert info["total_ms_per_step"] == pytest.approx(sum(ms.values()), abs=0.01)
    assert info["total_ms"]["verify"] == pytest.approx(2 * ms["verify"], abs=0.01)


def test_a_step_that_stops_midway_is_not_counted_and_clear_resets():
    times = StepTimes("cpu")
    run_step(times, upto=3)  # e.g. an exception inside verify
    run_step(times)
    assert times.info()["decode_steps_timed"] == 1
    times.clear()
    assert times.info() == {"decode_steps_timed": 0, "ms_per_step": dict.fromkeys(PHASES, 0.0),
                            "total_ms_per_step": 0.0, "total_ms": dict.fromkeys(PHASES, 0.0)}


def test_phases_must_be_marked_in_order():
    times = StepTimes("cpu")
    times.start()
    with pytest.raises(AssertionError, match="out of order"):
        times.mark("verify")
