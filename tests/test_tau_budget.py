"""benchmarks/tau_budget.py: the τ-vs-budget table reads each committed recipe record as recipe_report.py wrote it."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tau_budget  # noqa: E402

RECORD = ROOT / "benchmarks" / "results" / "recipe_smollm2_cpu_xeon_fresh.json"


def test_row_carries_the_records_own_figures():
    d = json.loads(RECORD.read_text())
    row = tau_budget.budget_row(RECORD)
    assert row["steps"] == d["steps"]
    assert row["wall_min"] == d["wall_min"] and row["train_min"] == d["phases_min"]["train"]
    assert row["wall_min"] != row["train_min"]  # the whole command, not the training phase
    taus = {s["name"]: s["tau"] for s in d["eval"]["dspark"]["datasets"]}
    assert row["tau"] == {s: taus[s] for s in tau_budget.SETS}
    plain = d["eval"]["plain"]["datasets"][0]["tokens_per_s"]
    spec = next(s["tokens_per_s"] for s in d["eval"]["dspark"]["datasets"] if s["name"] == "gsm8k")
    assert abs(row["vs_plain_gsm8k"] - spec / plain) < 1e-12
    data = d["recipe"]["data"]
    assert row["samples"] == data["max_samples"] + sum(m["max_samples"] for m in data["mix"])


def test_table_json_and_plot(tmp_path, capsys):
    files = [RECORD, ROOT / "benchmarks" / "results" / "recipe_smollm2_cpu_epyc_256.json"]
    tau_budget.main(files, out=tmp_path / "t.json", plot_out=tmp_path / "t.png")
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["cpu"] for r in rows] == sorted(r["cpu"] for r in rows)  # grouped by CPU
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert f"| {rows[0]['steps']} |" in table and RECORD.name in table
