"""The worker's per-phase decode-step clock (dspark_sgl/sglang/steptime.py): means per phase, incomplete steps.

The clock is a fake that moves only when a test says so: a phase's time is exact, however loaded the box is."""

import pytest

from dspark_sgl.sglang import steptime
from dspark_sgl.sglang.steptime import PHASES, StepTimes


class FakeClock:
    """Stands in for the `time` module inside steptime."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(steptime, "time", fake)
    return fake


def run_step(times: StepTimes, clock: FakeClock, slow: str | None = None, upto: int = len(PHASES)) -> None:
    times.start()
    for phase in PHASES[:upto]:
        if phase == slow:
            clock.now += 0.02
        times.mark(phase)


def test_means_per_phase_show_where_the_time_went(clock):
    times = StepTimes("cpu")
    run_step(times, clock, slow="verify")
    run_step(times, clock, slow="draft")
    info = times.info()
    assert info["decode_steps_timed"] == 2
    ms = info["ms_per_step"]
    assert ms == {p: 10.0 if p in ("verify", "draft") else 0.0 for p in PHASES}  # 20 ms in one of two steps each
    assert info["total_ms_per_step"] == pytest.approx(sum(ms.values()), abs=0.01)
    assert info["total_ms"]["verify"] == pytest.approx(2 * ms["verify"], abs=0.01)


def test_a_step_that_stops_midway_is_not_counted_and_clear_resets(clock):
    times = StepTimes("cpu")
    run_step(times, clock, upto=3)  # e.g. an exception inside verify
    run_step(times, clock)
    assert times.info()["decode_steps_timed"] == 1
    times.clear()
    zero = dict.fromkeys(PHASES, 0.0)
    assert times.info() == {"decode_steps_timed": 0, "ms_per_step": zero, "total_ms_per_step": 0.0,
                            "total_ms": zero, "off_steps_timed": 0, "off_ms_per_step": zero,
                            "off_total_ms_per_step": 0.0, "off_total_ms": zero}


def test_off_steps_skip_the_draft_and_are_counted_apart_and_reported(clock):
    seen = []
    times = StepTimes("cpu", on_step=lambda meta, s: seen.append((meta, s)))
    times.start(batch_size=4)
    times.note(speculate=False, width=1)
    for phase in ("decide", "verify", "accept", "commit"):
        clock.now += 0.01
        times.mark(phase)
    run_step(times, clock, slow="draft")
    info = times.info()
    assert info["off_steps_timed"] == 1 and info["decode_steps_timed"] == 1
    assert info["off_total_ms_per_step"] == pytest.approx(40.0) and info["total_ms_per_step"] == pytest.approx(20.0)
    assert seen[0][0] == {"speculate": False, "batch_size": 4, "width": 1}
    assert set(seen[0][1]) == {"decide", "verify", "accept", "commit"} and seen[1][1]["draft"] == pytest.approx(0.02)


def test_phases_must_be_marked_in_order():
    times = StepTimes("cpu")
    times.start()
    times.mark("verify")  # phases may be skipped (an off step has no draft) ...
    with pytest.raises(AssertionError, match="out of order"):
        times.mark("draft")  # ... but never go back
