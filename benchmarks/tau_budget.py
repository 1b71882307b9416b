"""τ against training budget: one row per committed recipe run (benchmarks/results/recipe_*.json, written by
recipe_report.py), a table, a JSON and a plot (τ per held-out set against the run's wall time, one marker per CPU).

    python benchmarks/tau_budget.py benchmarks/results/recipe_smollm2_cpu.json ... \
        --out benchmarks/results/tau_budget.json --plot docs/img/tau_budget.png

Runs on different CPUs or recipes are not one curve: each row names its CPU, sequence length, samples and steps, so
the reader compares like with like.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dspark_sgl.plots import pyplot, save_figure
from dspark_sgl.provenance import provenance

SETS = ("gsm8k", "humaneval", "mt-bench")


def budget_row(path: Path) -> dict:
    """The figures of one recipe result file that the τ-vs-budget table needs."""
    d = json.loads(path.read_text())
    data, ev = d["recipe"]["data"], d.get("eval") or {}
    taus = {s["name"]: s["tau"] for s in ev.get("dspark", {}).get("datasets", [])}
    plain = {s["name"]: s["tokens_per_s"] for s in ev.get("plain", {}).get("datasets", [])}
    spec = {s["name"]: s["tokens_per_s"] for s in ev.get("dspark", {}).get("datasets", [])}
    return {
        "file": str(path),
        "cpu": d["provenance"].get("cpu"),
        "wall_min": d.get("wall_min") or d["phases_min"].get("total"),
        "train_min": d["phases_min"].get("train"),
        "steps": d["steps"],
        "max_length": data.get("max_length"),
        # the caps (data.max_samples + each mix entry's), not counts
        "samples": (data.get("max_samples") or 0) + sum(m.get("max_samples") or 0 for m in data.get("mix") or []),
        "tau": {s: taus.get(s) for s in SETS},
        "vs_plain_gsm8k": spec["gsm8k"] / plain["gsm8k"] if "gsm8k" in plain and "gsm8k" in spec else None,
    }


def plot(rows: list[dict], out: Path) -> Path:
    """τ against wall time (left: what a budget bought on that day) and against steps (right: what training bought;
    a line joins one CPU's runs of one sample length, the same recipe's points). Wall time alone zigzags: one CPU's
    hour buys 1,100 steps on a slow day and 1,700 on a fast one."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), sharey=True)
    cpus = sorted({r["cpu"] for r in rows})
    markers = dict(zip(cpus, "os^D", strict=False))
    for k, s in enumerate(SETS):
        for cpu in cpus:
            mine = [r for r in rows if r["cpu"] == cpu and r["tau"][s] is not None]
            left.scatter([r["wall_min"] for r in mine], [r["tau"][s] for r in mine], color=f"C{k}", marker=markers[cpu])
            for length in sorted({r["max_length"] for r in mine}):
                pts = sorted((r["steps"], r["tau"][s]) for r in mine if r["max_length"] == length)
                right.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{k}", marker=markers[cpu], alpha=0.8)
        left.plot([], [], color=f"C{k}", label=s)
    for cpu in cpus:
        left.scatter([], [], color="gray", marker=markers[cpu], label=cpu.split(",")[0])
    left.set_xlabel("recipe wall time (min, 2 cores)")
    left.set_ylabel("τ (held-out, first 50, T=0)")
    right.set_xscale("log", base=2)
    right.set_xlabel("training steps (global batch 8; lines: one CPU, one sample length)")
    left.legend(fontsize=7)
    return save_figure(fig, out)


def main(files: Annotated[list[Path], typer.Argument(help="recipe_report.py result files.")],
         out: Annotated[Path | None, typer.Option(help="Result JSON to write.")] = None,
         plot_out: Annotated[Path | None, typer.Option("--plot", help="PNG to write.")] = None) -> None:
    rows = sorted((budget_row(f) for f in files), key=lambda r: (r["cpu"], r["wall_min"]))
    print("wall min | CPU | max_length | sample caps | steps | τ GSM8K | τ HumanEval | τ MT-Bench | vs plain (GSM8K) "
          "| file")
    print("---|---|---|---|---|---|---|---|---|---")
    for r in rows:
        t = [f"{r['tau'][s]:.3f}" if r["tau"][s] is not None else "–" for s in SETS]
        ratio = f"{r['vs_plain_gsm8k']:.2f}×" if r["vs_plain_gsm8k"] else "–"
        print(f"{r['wall_min']:.1f} | {r['cpu']} | {r['max_length']} | {r['samples']} | {r['steps']} | "
              f"{' | '.join(t)} | {ratio} | {Path(r['file']).name}")
    if plot_out is not None:
        print(f"wrote {plot(rows, plot_out)}")
    if out is not None:
        out.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
