import json
import random

import pytest
import torch

from dspark_sgl.speculative.sps import SpsTable, default_token_counts, isotonic_non_increasing, profile_sps


def _slow_isotonic(values):
    """Reference: the non-increasing vector closest in squared error, by brute force over level sets
    (minimum over all monotone step functions is reached at block means; checked by exhaustive merge)."""
    best, best_err = None, float("inf")
    n = len(values)
    for mask in range(1 << (n - 1)):  # every partition into contiguous blocks
        fit, start = [], 0
        for i in range(n):
            if i == n - 1 or mask >> i & 1:
                block = values[start : i + 1]
                fit += [sum(block) / len(block)] * len(block)
                start = i + 1
        if all(b <= a + 1e-12 for a, b in zip(fit, fit[1:], strict=False)):
            err = sum((f - v) ** 2 for f, v in zip(fit, values, strict=True))
            if err < best_err:
                best, best_err = fit, err
    return best


def test_isotonic_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        values = [rng.uniform(0, 10) for _ in range(rng.randint(1, 8))]
        assert isotonic_non_increasing(values) == pytest.approx(_slow_isotonic(values))


def test_smoothing_is_monotone_and_keeps_raw():
    table = SpsTable([1, 2, 4, 8, 16], [100.0, 104.0, 90.0, 95.0, 40.0]).smoothed()
    assert table.is_monotone()
    assert table.steps_per_s == pytest.approx([102.0, 102.0, 92.5, 92.5, 40.0])
    assert table.meta["raw_steps_per_s"] == [100.0, 104.0, 90.0, 95.0, 40.0]
    assert not SpsTable([1, 2], [1.0, 2.0]).is_monotone()


def test_floor_lookup_and_clamp():
    table = SpsTable([2, 4, 8], [50.0, 40.0, 10.0])
    got = table.lookup(torch.tensor([0, 1, 2, 3, 4, 7, 8, 100]))
    assert got.tolist() == [50.0, 50.0, 50.0, 50.0, 40.0, 40.0, 10.0, 10.0]
    assert got.dtype == torch.float64
    assert table(5) == 40.0


def test_json_roundtrip(tmp_path):
    table = SpsTable([1, 3, 9], [30.0, 20.0, 5.0], {"device": "cpu"})
    table.save(tmp_path / "sps.json")
    loaded = SpsTable.load(tmp_path / "sps.json")
    assert loaded == table
    assert json.loads((tmp_path / "sps.json").read_text())["tokens"] == [1, 3, 9]


@pytest.mark.parametrize(
    "tokens, sps",
    [([], []), ([1, 2], [1.0]), ([2, 2], [1.0, 1.0]), ([0, 1], [1.0, 1.0]), ([1, 2], [1.0, 0.0])],
)
def test_bad_tables_raise(tokens, sps):
    with pytest.raises(ValueError):
        SpsTable(tokens, sps)


def test_load_rejects_wrong_json(tmp_path):
    (tmp_path / "bad.json").write_text('{"tokens": [1]}')
    with pytest.raises(ValueError, match="steps_per_s"):
        SpsTable.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        SpsTable.load(tmp_path / "missing.json")


def test_default_token_counts():
    assert default_token_counts(1) == [1]
    assert default_token_counts(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    counts = default_token_counts(512)
    assert counts[-1] == 512 and counts == sorted(set(counts)) and len(counts) <= 20
    with pytest.raises(ValueError):
        default_token_counts(0)


def test_profile_sps_times_the_callable(monkeypatch):
    """A fake clock makes step n take n milliseconds, except one noisy bump at n=4."""
    now = [0.0]
    cost = {1: 1e-3, 2: 2e-3, 4: 1e-3, 8: 8e-3}
    calls = []

    def step(n):
        calls.append(n)
        now[0] += cost[n]

    monkeypatch.setattr("dspark_sgl.speculative.sps.time.perf_counter", lambda: now[0])
    raw = profile_sps(step, [8, 1, 2, 4], warmup=1, repeats=3, smooth=False)
    assert raw.tokens == [1, 2, 4, 8]
    assert raw.steps_per_s == pytest.approx([1000.0, 500.0, 1000.0, 125.0])
    assert calls.count(4) == 4  # 1 warmup + 3 timed
    smooth = profile_sps(step, [1, 2, 4, 8], warmup=0, repeats=1)
    assert smooth.is_monotone() and smooth.steps_per_s == pytest.approx([1000.0, 750.0, 750.0, 125.0])
