"""The step clock on CUDA (dspark_sgl/sglang/steptime.py) never waits inside a step: a step's events are read once
they have completed (`query`), a step or more late; only `info()`, called outside any step, waits. Fake events stand
in for torch.cuda.Event so this runs on a CPU."""

from __future__ import annotations

from dspark_sgl.sglang.steptime import PHASES, StepTimes


class FakeEvent:
    """A CUDA event that completes only when the test says so; waiting on an incomplete one is recorded."""

    def __init__(self, t: float, log: list):
        self.t, self.done, self.log = t, False, log

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append("waited")
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t - self.t


def cuda_clock() -> tuple[StepTimes, list[FakeEvent], list]:
    times, events, log = StepTimes("cpu"), [], []
    times.cuda = True

    def now():
        events.append(FakeEvent(float(len(events)), log))
        return events[-1]

    times._now = now
    return times, events, log


def step(times: StepTimes) -> None:
    times.start()
    for phase in PHASES:
        times.mark(phase)


def test_a_step_still_running_is_read_later_without_waiting():
    times, events, log = cuda_clock()
    step(times)
    step(times)  # the first step's events are still in flight: no wait, nothing summed yet
    assert log == [] and times.steps == 0
    for e in events[: len(PHASES) + 1]:
        e.done = True  # the first step has finished on the device
    step(times)  # read now, one step late
    assert log == [] and times.steps == 1
    assert times.total_ms == dict.fromkeys(PHASES, 1.0)  # one fake ms between consecutive marks


def test_info_outside_a_step_waits_for_every_finished_step():
    times, events, log = cuda_clock()
    step(times)
    step(times)
    info = times.info()
    assert info["decode_steps_timed"] == 2 and log == ["waited", "waited"]
