"""One committed record of a training-recipe run: wall time by phase, τ per held-out set with per-position
acceptance, the speed ratio, the STS calibration and the training curve's end, with CPU, commit and date.

    python benchmarks/recipe_report.py runs/smollm2-135m-cpu --out benchmarks/results/recipe_smollm2_cpu.json

Reads the run folder the trainer wrote (recipe.json, phases.json, metrics.jsonl, eval.json, draft/sts.json) and
prints the table the README and docs/training.md quote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dspark_sgl.provenance import provenance
from training.trainer import read_metrics


def summarise_run(run: Path) -> dict:
    phases = json.loads((run / "phases.json").read_text())
    last = read_metrics(run / "metrics.jsonl")
    tail = [last[s] for s in sorted(last)[-10:]]
    out = {
        "run": str(run),
        "recipe": json.loads((run / "recipe.json").read_text()),
        "phases_min": {k: round(v / 60, 2) for k, v in phases.items()},
        "steps": max(last),
        "train_tail": {k: round(sum(m[k] for m in tail) / len(tail), 4) for k in ("loss", "tau_prob", "acc")},
        "eval": json.loads((run / "eval.json").read_text()) if (run / "eval.json").exists() else None,
    }
    sts = run / "draft" / "sts.json"
    if sts.exists():
        out["sts"] = json.loads(sts.read_text())
    return out


def table(summary: dict) -> str:
    ph = summary["phases_min"]
    lines = ["phase | minutes", "---|---", *(f"{k} | {v:.1f}" for k, v in ph.items())]
    ev = summary["eval"]
    if ev:
        plain = {d["name"]: d for d in ev.get("plain", {}).get("datasets", [])}
        lines += ["", "set | prompts | τ | per-position accept | tok/s | vs plain", "---|---|---|---|---|---"]
        for d in ev["dspark"]["datasets"]:
            p = plain.get(d["name"])
            ratio = f"{d['tokens_per_s'] / p['tokens_per_s']:.2f}×" if p else "–"
            acc = ", ".join(f"{a:.2f}" for a in d["per_position_accept"])
            lines.append(f"{d['name']} | {d['prompts']} | {d['tau']:.3f} | {acc} | {d['tokens_per_s']:.1f} | {ratio}")
    return "\n".join(lines)


def main(run: Annotated[Path, typer.Argument(help="The run folder (train.out_dir).")],
         out: Annotated[Path | None, typer.Option(help="Result JSON to write.")] = None,
         wall_min: Annotated[float | None, typer.Option(help="Whole-command wall time (e.g. /usr/bin/time).")] = None,
         note: Annotated[str, typer.Option(help="What else the reader must know (box shared, cache state).")] = ""):
    summary = summarise_run(run)
    summary["wall_min"] = wall_min
    summary["note"] = note
    print(table(summary))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"provenance": provenance(run=str(run)), **summary}, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
