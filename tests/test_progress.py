"""Progress lines work in a log file: counts, s/it and an ETA, at most every `every_s` and always at the end."""

import io

from dspark_sgl.progress import ProgressLine, fmt_duration


def test_progress_lines_are_rate_limited_and_end_with_the_total():
    out = io.StringIO()
    p = ProgressLine("regenerate", 5, every_s=3600, stream=out)
    assert p.update(2) is None  # too soon
    last = p.update(3)
    assert last is not None and last.startswith("regenerate 5/5 ") and "s/it" in last and "ETA 0:00" in last
    assert out.getvalue().count("\n") == 1
    assert p.update(0, force=True) is not None


def test_durations_read_as_clock_times():
    assert fmt_duration(65) == "1:05" and fmt_duration(3725) == "1:02:05"
