import json
import math

import pytest
import torch

from dspark_sgl.speculative.sts import (
    apply_sts,
    auroc,
    brier,
    calibration_report,
    ece,
    fit_sts,
    load_sts,
    save_sts,
    survival_labels,
)

TRUE_T = [2.0, 0.5, 3.0, 1.0, 0.7, 1.5, 4.0]


def synthetic(n, temps, seed):
    """Calibrated logits z* (draft k survives with probability sigmoid(z*_k) given the prefix survived),
    then distorted to z = z* * T so that sigmoid(z / T) is the calibrated confidence."""
    gen = torch.Generator().manual_seed(seed)
    z_true = 1.8 + 1.5 * torch.randn(n, len(temps), generator=gen, dtype=torch.float64)
    survives = torch.rand(n, len(temps), generator=gen, dtype=torch.float64) < torch.sigmoid(z_true)
    accepted = survives.long().cumprod(1).sum(1)
    return z_true * torch.tensor(temps, dtype=torch.float64), accepted


def test_sts_recovers_known_temperatures():
    logits, accepted = synthetic(20000, TRUE_T, seed=0)
    fitted = fit_sts(logits, accepted)
    assert (fitted.log() - torch.tensor(TRUE_T).log()).abs().max() < 0.25  # within ~28 % everywhere
    held_logits, held_accepted = synthetic(20000, TRUE_T, seed=1)
    before = calibration_report(held_logits, held_accepted)
    after = calibration_report(held_logits, held_accepted, fitted)
    oracle = calibration_report(held_logits, held_accepted, torch.tensor(TRUE_T))
    assert sum(before["ece"]) / 7 > 0.04
    assert max(after["ece"]) < 0.02 and sum(after["ece"]) / 7 < 0.012
    assert all(a < o + 0.005 for a, o in zip(after["ece"], oracle["ece"], strict=True))
    assert all(a < b for a, b in zip(after["brier"], before["brier"], strict=True))
    assert after["auroc"][0] == pytest.approx(before["auroc"][0])  # a temperature cannot reorder position 1


def test_uninformative_logits_keep_unit_temperature():
    accepted = torch.randint(0, 4, (500,), generator=torch.Generator().manual_seed(0))
    assert fit_sts(torch.zeros(500, 3), accepted).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_survival_labels_and_apply():
    assert survival_labels(torch.tensor([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    z = torch.tensor([[2.0, -1.0]])
    assert torch.equal(apply_sts(z, None), torch.sigmoid(z))
    expected = torch.sigmoid(torch.tensor([[1.0, -2.0]]))
    torch.testing.assert_close(apply_sts(z, torch.tensor([2.0, 0.5])), expected)
    with pytest.raises(ValueError, match="temperatures"):
        apply_sts(z, torch.tensor([1.0, 1.0, 1.0]))


def _slow_ece(prob, label, n_bins):
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [
            (p, y) for p, y in zip(prob, label, strict=True) if lo <= p < hi or (b == n_bins - 1 and p == 1.0)
        ]
        total += abs(sum(p - y for p, y in members))
    return total / len(prob)


def _slow_auroc(score, label):
    pos = [s for s, y in zip(score, label, strict=True) if y]
    neg = [s for s, y in zip(score, label, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_metrics_match_slow_references():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        prob = torch.rand(300, generator=gen, dtype=torch.float64)
        if trial % 2:
            prob = (prob * 10).round() / 10  # ties for AUROC, values on bin edges, exact 0 and 1
        label = (torch.rand(300, generator=gen, dtype=torch.float64) < prob).double()
        for n_bins in (1, 10, 15):
            assert float(ece(prob, label, n_bins)) == pytest.approx(
                _slow_ece(prob.tolist(), label.tolist(), n_bins)
            )
        assert auroc(prob, label) == pytest.approx(_slow_auroc(prob.tolist(), label.tolist()))
        assert float(brier(prob, label)) == pytest.approx(((prob - label) ** 2).mean().item())
    assert math.isnan(auroc(torch.rand(5), torch.ones(5)))


def test_ece_is_batched_over_leading_dims():
    prob = torch.rand(4, 100, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    label = (prob > 0.5).double()
    assert ece(prob, label).tolist() == pytest.approx(
        [float(ece(p, y)) for p, y in zip(prob, label, strict=True)]
    )


def test_save_load_roundtrip(tmp_path):
    temps = torch.tensor([1.5, 0.8, 2.0], dtype=torch.float64)
    save_sts(tmp_path / "sts.json", temps, {"ece": [0.1, 0.1, 0.1]})
    assert torch.equal(load_sts(tmp_path / "sts.json", gamma=3), temps)
    assert json.loads((tmp_path / "sts.json").read_text())["report"]["ece"] == [0.1, 0.1, 0.1]
    (tmp_path / "bare.json").write_text("[1.0, 2.0]")
    assert load_sts(tmp_path / "bare.json").tolist() == [1.0, 2.0]


def test_bad_inputs_raise(tmp_path):
    save_sts(tmp_path / "s.json", torch.ones(3))
    with pytest.raises(ValueError, match="gamma=7"):
        load_sts(tmp_path / "s.json", gamma=7)
    (tmp_path / "neg.json").write_text('{"temperatures": [1.0, -2.0]}')
    with pytest.raises(ValueError, match="positive temperatures"):
        load_sts(tmp_path / "neg.json")
    with pytest.raises(FileNotFoundError):
        load_sts(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"\[N, gamma\]"):
        fit_sts(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="no calibration samples"):
        fit_sts(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="grid"):
        fit_sts(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), grid=torch.tensor([0.0, 1.0]))
