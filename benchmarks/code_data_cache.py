"""Issue 40, lever 3: a finished data cache plus the target's T=0 answers to HumanEval prompts after the held-out 50.

    python benchmarks/code_data_cache.py --base-cache runs/smollm2-135m-cpu/data --out runs/code-data --copies 4

The base cache's regenerated answers are reused (its regen-*.jsonl are copied); the recipe's data phase
(`training.data.prepare_samples`, the recipe's own data section with `--override`s) then runs with one more mix
source, HumanEval records 50.. (decontaminated against the first 50 of every eval file), so only those are generated
and the rest re-tokenised. `--copies k` is the source's `repeat`: k - 1 more copies of the HumanEval samples under new
ids (the trainer has no per-source weight): with 4, about 6 % of the stop-40 cache's samples are code. LiveCodeBench
is not used: its prompts' median is 596 tokens, past the recipe's 256-token samples. Use the result as
`recipe_ablation.py --data-cache` (`benchmarks/results/ablation_code_data_xeon.json`)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from dspark_sgl.provenance import ROOT
from training.data import SOURCE_ID_STRIDE, SourceConfig, prepare_samples
from training.recipe import load_recipe
from training.target import resolve_target_path

EVAL_DIR = ROOT.parent / "shared" / "data" / "eval"


def main(
    base_cache: Annotated[Path, typer.Option(help="A finished data cache (samples.jsonl + regen-*.jsonl).")],
    out: Annotated[Path, typer.Option(help="The new cache folder (must not hold a samples.jsonl).")],
    copies: Annotated[int, typer.Option(min=1, help="HumanEval samples appear this many times.")] = 4,
    override: Annotated[list[str] | None, typer.Option(help="Recipe overrides (k=v) that made the base cache.")] = None,
    eval_dir: Annotated[Path, typer.Option(help="The eval files (HumanEval's and the exclusion's).")] = EVAL_DIR,
    threads: Annotated[int, typer.Option(min=1)] = 2,
) -> None:
    if (out / "samples.jsonl").exists():
        raise typer.BadParameter(f"{out} already holds a samples.jsonl", param_hint="--out")
    torch.set_num_threads(threads)
    recipe = load_recipe(ROOT / "configs" / "smollm2-135m-cpu.yaml",
                         [f"data.train={eval_dir / 'gsm8k.jsonl'}", f"data.exclude.files=[{eval_dir}]",
                          *(override or [])])
    cfg = recipe.data
    cfg.mix = [m for m in cfg.mix if not m.train.endswith("humaneval.jsonl")]  # the recipe's own code source
    cfg.mix.append(SourceConfig(str(eval_dir / "humaneval.jsonl"), skip_samples=50, repeat=copies))
    out.mkdir(parents=True, exist_ok=True)
    for f in base_cache.glob("regen-*.jsonl"):
        shutil.copy(f, out / f.name)
    t0 = time.time()
    samples, _ = prepare_samples(cfg, resolve_target_path(recipe.target.path), out, 0, 1, lambda: None)
    j = len(cfg.mix)  # the HumanEval source's index; its copies are pseudo-sources j + 1 .. (training.data.repeated)
    code = [s for s in samples if s.id // SOURCE_ID_STRIDE == j]
    print(f"{len(samples) - len(code) * (copies - 1)} samples ({len(code)} HumanEval) in {time.time() - t0:.0f} s, "
          f"+ {len(code) * (copies - 1)} copies -> {out / 'samples.jsonl'}")

if __name__ == "__main__":
    typer.run(main)
