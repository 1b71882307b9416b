"""Recipe ablations on one clock: each lever alone against the CPU recipe, same data, same steps, same eval.

    python benchmarks/recipe_ablation.py --data-cache runs/smollm2-135m-cpu/data --root runs/ablation \
        --variant base --variant "lr12 optim.lr=1.2e-2" --variant "ce1 objective.ce_weight=1.0" \
        --out benchmarks/results/ablation_smollm2_cpu.json

Why this shape: a full recipe run costs an hour of the two cores, so levers are compared on short runs that share
everything else. Every variant copies the same finished data cache (regenerated + tokenised samples of a recipe run:
no variant pays or varies the data phase), trains `--steps` optimizer steps with the LR decaying to 0 at the last
one (2 ranks, `torchrun`; the recipe's `train.minutes` is switched off, or its time-based cosine would leave the LR
near its peak after a few minutes of steps), exports, and runs `dspark eval` on the first `--prompts` held-out
prompts of each set (T=0, `--max-new-tokens`, dtype auto, batch 10). τ at a fixed step count does not depend on
how loaded the box was; the seconds per step do (say so when quoting them). A variant whose eval.json exists is not
run again (re-running the script after an interruption finishes the rest).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from dspark_sgl.provenance import ROOT, provenance
from training.trainer import read_metrics

RECIPE = ROOT / "configs" / "smollm2-135m-cpu.yaml"
EVAL_DIR = ROOT.parent / "shared" / "data" / "eval"
SETS = ("gsm8k", "humaneval", "mt-bench")


def train_variant(folder: Path, overrides: list[str], data_cache: Path, steps: int, eval_dir: Path) -> float:
    """Train one variant from a private copy of the data cache; returns the wall seconds."""
    if (folder / "data").exists():
        shutil.rmtree(folder / "data")
    shutil.copytree(data_cache, folder / "data")
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "-m", "training",
           "--config", str(RECIPE), f"train.out_dir={folder / 'run'}", f"data.cache_dir={folder / 'data'}",
           f"train.max_steps={steps}", "train.minutes=null", "train.save_every=1000", "eval.datasets=[]",
           "eval.calibrate_prompts=0",
           "train.wandb_mode=disabled", f"data.train={eval_dir / 'gsm8k.jsonl'}",
           f"data.exclude.files=[{eval_dir}]", *overrides]
    t0 = time.time()
    with open(folder / "train.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return time.time() - t0


def eval_draft(draft: Path, out: Path, prompts: int, max_new_tokens: int, eval_dir: Path, log_file: Path,
               target: str = "smollm2") -> None:
    """`dspark eval` of one draft folder on the first `prompts` held-out prompts of each set (T=0, batch 10)."""
    cmd = [str(Path(sys.executable).with_name("dspark")), "eval", "--target", target, "--draft", str(draft),
           *[a for s in SETS for a in ("--data", str(eval_dir / f"{s}.jsonl"))], "--limit", str(prompts),
           "--max-new-tokens", str(max_new_tokens), "--batch-size", "10", "--json-out", str(out)]
    with open(log_file, "w") as log:
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"}, stdout=log,
                       stderr=subprocess.STDOUT, check=True)


def eval_variant(folder: Path, prompts: int, max_new_tokens: int, eval_dir: Path) -> None:
    eval_draft(folder / "run" / "draft", folder / "eval.json", prompts, max_new_tokens, eval_dir, folder / "eval.log")


def probe_variant(folder: Path) -> None:
    """benchmarks/context_probe.py on the variant's run (its own data copy): per-slot agreement with and without
    context, and where slot 0's attention goes (on a−1 or not)."""
    link = folder / "run" / "data"
    if not link.exists():
        link.symlink_to(folder / "data")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "context_probe.py"), str(folder / "run"), "--threads", "2",
           "--out", str(folder / "probe.json")]
    with open(folder / "probe.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                       stderr=subprocess.STDOUT, check=True)


def probe_summary(folder: Path) -> dict | None:
    """Slot 0's agreement intact / without context and its attention mass on a−1 per layer, or None (no probe)."""
    if not (folder / "probe.json").exists():
        return None
    p = json.loads((folder / "probe.json").read_text())
    agree = p["per_slot_agreement"]
    return {"slot0_agree": round(agree["intact"][0], 4), "slot0_agree_no_context": round(agree["no_context"][0], 4),
            "slot0_attention_a-1": {layer: slots["slot 0"]["a-1"]
                                    for layer, slots in (p["attention_by_distance"] or {}).items()}}


def lever_of(name: str) -> str:
    """Variants NAME, NAME_s43, ... are seeds of one lever."""
    head, _, tail = name.rpartition("_s")
    return head if head and tail.isdigit() else name


def summarise(name: str, overrides: list[str], folder: Path) -> dict:
    rows = read_metrics(folder / "run" / "metrics.jsonl")
    tail = [rows[s] for s in sorted(rows)[-20:]]
    ev = json.loads((folder / "eval.json").read_text())
    return {
        "name": name, "overrides": overrides, "steps": max(rows),
        "tau_prob_last20": round(sum(r["tau_prob"] for r in tail) / len(tail), 4),
        "acc0_last20": round(sum(r["acc_0"] for r in tail) / len(tail), 4),
        "s_per_step_last20": round(sum(r["step_s"] for r in tail) / len(tail), 3),
        "probe": probe_summary(folder),
        "eval": {d["name"]: {"tau": round(d["tau"], 4), "per_position_accept": [round(a, 4) for a in
                                                                               d["per_position_accept"]]}
                 for d in ev.get("dspark", ev)["datasets"]},
    }


def main(variant: Annotated[list[str], typer.Option(help="'NAME key=value ...' (repeatable; 'base' = no change).")],
         data_cache: Annotated[Path, typer.Option(help="A finished recipe run's data folder (train.out_dir/data).")],
         root: Annotated[Path, typer.Option(help="Where the variants' runs go.")] = Path("runs/ablation"),
         steps: Annotated[int, typer.Option(min=1)] = 120,
         prompts: Annotated[int, typer.Option(min=1)] = 20,
         max_new_tokens: Annotated[int, typer.Option(min=1)] = 96,
         eval_dir: Annotated[Path, typer.Option(help="The held-out sets (never trained on).")] = EVAL_DIR,
         note: Annotated[str, typer.Option(help="What else the reader must know (box shared, ...).")] = "",
         probe: Annotated[bool, typer.Option(help="Run benchmarks/context_probe.py on each variant too.")] = False,
         out: Annotated[Path | None, typer.Option(help="Result JSON to write.")] = None) -> None:
    results = []
    for spec in variant:
        name, *overrides = shlex.split(spec)
        folder = (root / name).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "eval.json").exists():
            if not (folder / "run" / "draft" / "model.safetensors").exists():
                train_variant(folder, overrides, data_cache.resolve(), steps, eval_dir.resolve())
            eval_variant(folder, prompts, max_new_tokens, eval_dir.resolve())
        if probe and not (folder / "probe.json").exists():
            probe_variant(folder)
        results.append(summarise(name, overrides, folder))
    base = next((r for r in results if r["name"] == "base"), None)
    print("variant | overrides | τ_prob (last 20) | s/step | " + " | ".join(f"τ {s}" for s in SETS))
    print("---|---|---|---|" + "---|" * len(SETS))
    for r in results:
        taus = []
        for s in SETS:
            t = r["eval"][s]["tau"]
            d = f" ({t - base['eval'][s]['tau']:+.3f})" if base and r is not base else ""
            taus.append(f"{t:.3f}{d}")
        print(f"{r['name']} | {' '.join(r['overrides']) or '—'} | {r['tau_prob_last20']:.3f} | "
              f"{r['s_per_step_last20']:.2f} | " + " | ".join(taus))
    levers = {}
    for r in results:
        levers.setdefault(lever_of(r["name"]), []).append(r)
    if any(len(v) > 1 for v in levers.values()):  # seeds: the mean per lever, and its delta to base's mean
        mean = {k: {s: sum(r["eval"][s]["tau"] for r in v) / len(v) for s in SETS} for k, v in levers.items()}
        print("\nlever | seeds | " + " | ".join(f"mean τ {s}" for s in SETS))
        print("---|---|" + "---|" * len(SETS))
        for k, v in levers.items():
            delta = {s: f" ({mean[k][s] - mean['base'][s]:+.3f})" if "base" in mean and k != "base" else ""
                     for s in SETS}
            print(f"{k} | {len(v)} | " + " | ".join(f"{mean[k][s]:.3f}{delta[s]}" for s in SETS))
    if out is not None:
        record = {"provenance": provenance(recipe=str(RECIPE.relative_to(ROOT)), steps=steps, prompts=prompts,
                                          max_new_tokens=max_new_tokens, data_cache=str(data_cache), sets=SETS),
                  "note": note, "variants": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
