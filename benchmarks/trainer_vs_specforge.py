"""Our trainer against SpecForge 0.2.0 (the trainer a user would otherwise pick) at equal wall time, same 2 cores.

    python benchmarks/trainer_vs_specforge.py --minutes 12 --json-out benchmarks/results/trainer_vs_specforge_xeon.json

What is held equal: the target (the recipe's SmolLM2-135M-Instruct), the training samples (the recipe's decontaminated
mixture, regenerated and tokenised once by training/data.py into `--data-cache` BEFORE either clock starts: both
start from the same token ids), the draft architecture (the recipe's draft section; SpecForge has no reduced draft
vocabulary, so `--same-vocab` trains ours at the full vocabulary too, else ours keeps the recipe's 8,192-token head and
the row says so), the optimiser settings (lr, warmup, clip, global batch, anchors, γ decay, loss weights), the
processes and the wall budget: each trainer gets `--minutes` from its launch. By default both run AT THE SAME TIME,
each on half of `--nproc` (1 rank × 1 thread each on 2 cores), each in its own session: on a shared box (the kernel's
autogroup scheduler shares the CPU between sessions, whatever their nice) the others' load then hits both alike.
`--no-concurrent` runs them one after the other on all of `--nproc`.

- ours: `torchrun -m training` with `train.minutes=M` (its data phase reads the shared cache; the target prefill of
  epoch 1 is inside its steps, as in the recipe); a checkpoint every `train.save_every` steps.
- specforge: its offline path. The clock starts, then the target's hidden states are captured into SpecForge's
  `.ckpt` files (our HF target, bf16: aux layers = outputs of target layers `target_layer_ids`, HF
  `hidden_states[i+1]`, which is what SpecForge's SGLang capture records: sglang llama.py `layers_to_capture =
  [i + 1 for i in layer_ids]`; `target_last_hidden_states` = the post-final-norm state, because SpecForge applies
  the LM head to it with no norm: dflash_family_model.py `_aligned_target_hidden` -> `self.lm_head(...)`) until
  `--capture-share` of the budget is spent or every sample is captured, then `specforge train` (strategy dspark,
  NO_SHARD/DDP, sdpa, bf16) runs until the budget ends (killed there; its LR cosine is planned for
  `--specforge-step-s` seconds per step, its warmup is ours' in steps, or in wall time with `--ours-step-s`: both
  step times come from a short calibration run of the two side by side) and saves every `save_every` steps.

Checkpoints nearest to `--points` evenly spaced fractions of the budget are exported (ours: our exporter; SpecForge:
`specforge export --to hf`, read by `dspark eval` as it is) and evaluated by `dspark eval` on the first `--prompts`
held-out prompts of GSM8K, HumanEval and MT-Bench (T=0, `--max-new-tokens`). Exports and evals are outside the clocks.
τ at a checkpoint does not depend on load; the step count reached in the budget does: run it under the bench lock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import torch
import typer
import yaml

from dspark_sgl.provenance import ROOT, provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_ablation import EVAL_DIR, RECIPE, SETS, eval_draft  # noqa: E402

BIN = Path(sys.executable).parent


# ---- the shared, untimed data phase --------------------------------------------------------------------------
def load(recipe_path: Path, overrides: list[str]):
    from training.recipe import load_recipe
    from training.target import draft_config, resolve_target_path, target_config

    recipe = load_recipe(recipe_path, overrides)
    return recipe, draft_config(recipe, target_config(recipe)), resolve_target_path(recipe.target.path)


def prepare_data(recipe, target_dir: Path, cache: Path) -> list:
    """The recipe's samples (training/data.py: mixture, decontamination, regeneration), cached once for both."""
    from training.data import prepare_samples

    samples, _ = prepare_samples(recipe.data, target_dir, cache, 0, 1, lambda: None, None)
    return samples


# ---- ours ----------------------------------------------------------------------------------------------------
def run_ours(recipe_path: Path, overrides: list[str], folder: Path, data_cache: Path, minutes: float,
             nproc: int, startup_s: float) -> dict:
    """Our trainer for `minutes` from its launch: its time-based LR cosine is given the budget less `startup_s`
    (torchrun and imports happen before its clock starts); only checkpoints written within the budget count."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(data_cache, folder / "data")
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "-m", "training", "--config", str(recipe_path),
           *overrides, f"train.out_dir={folder / 'run'}", f"data.cache_dir={folder / 'data'}",
           f"train.minutes={minutes - startup_s / 60:.4f}", "train.max_steps=null",
           "train.keep_checkpoints=100000",
           "eval.datasets=[]", "eval.calibrate_prompts=0", "train.wandb_mode=disabled", "train.progress=false"]
    t0 = time.time()
    with open(folder / "train.log", "w") as log:  # its own session, like SpecForge's (the scheduler's fair share)
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                       stderr=subprocess.STDOUT, check=True, start_new_session=True)
    ckpts = {int(p.name.split("-")[1]): p.stat().st_mtime - t0 for p in (folder / "run" / "checkpoints").glob("step-*")
             if p.is_dir() and not p.name.endswith(".tmp")}
    phases = json.loads((folder / "run" / "phases.json").read_text())
    return {"launched": t0, "wall_s": time.time() - t0, "startup_s": startup_s, "phases_s": phases,
            "checkpoints": {s: w for s, w in ckpts.items() if w <= 60 * minutes + 5}}


def export_ours(recipe_path: Path, overrides: list[str], folder: Path, step: int, out: Path) -> Path:
    """One of our DCP checkpoints -> the canonical draft folder (what the trainer's own export writes)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dspark_sgl.model.draft import DSparkDraft
    from training.trainer import fold_aux_scale

    _, dcfg, _ = load(recipe_path, overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    flat = out.with_suffix(".pt")
    dcp_to_torch_save(str(folder / "run" / "checkpoints" / f"step-{step:08d}"), str(flat))
    model = torch.load(flat, weights_only=False)["model"]
    flat.unlink()
    draft = DSparkDraft(dcfg)
    draft.load_state_dict(fold_aux_scale(model), strict=True)  # as Trainer.export does with the live model
    draft.save_pretrained(out)
    return out


# ---- SpecForge -----------------------------------------------------------------------------------------------
def write_ckpt(path: Path, sample, aux: torch.Tensor, last: torch.Tensor) -> None:
    """One SpecForge offline sample (dflash_family_data.normalize_dspark_offline_sample's keys and shapes)."""
    torch.save({"input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
                "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long),
                "hidden_states": aux.contiguous().clone(), "target_last_hidden_states": last.contiguous().clone()},
               path)


@torch.no_grad()
def capture(target, samples: list, out: Path, deadline: float, dtype: torch.dtype, batch: int = 8) -> int:
    """Capture samples in order into out/*.ckpt until the deadline; returns how many were written."""
    from training.data import collate

    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for i in range(0, len(samples), batch):
        if time.time() >= deadline:
            break
        chunk = samples[i : i + batch]
        ids, _, lengths, _ = collate(chunk, 0)
        attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        cap = target.capture(ids, attn)
        for b, s in enumerate(chunk):
            T = len(s.input_ids)
            write_ckpt(out / f"data_{s.id}.ckpt", s, cap.aux[b, :T].to(dtype), cap.last_hidden[b, :T].to(dtype))
            n += 1
    return n


def specforge_config(recipe, dcfg, target_dir: Path, folder: Path, max_steps: int, nproc: int, dtype: str,
                     warmup_steps: int = 0) -> Path:
    """SpecForge's run YAML with the recipe's hyperparameters (reference notes, last section: the CPU settings);
    its warmup is ours in steps (ours: warmup_ratio of the recipe's epoch-bound step count)."""
    draft_json = folder / "draft_config.json"
    draft_json.write_text(json.dumps(dcfg.to_dict(), indent=2))
    o, t, r = recipe.objective, recipe.train, recipe.optim
    per_rank = t.global_batch // nproc
    cfg = {
        "model": {"target_model_path": str(target_dir), "draft_model_config": str(draft_json),
                  "torch_dtype": dtype, "embedding_key": "model.embed_tokens.weight",
                  "lm_head_key": "lm_head.weight", "mask_token_id": dcfg.mask_token_id},
        "data": {"hidden_states_path": str(folder / "features"), "max_length": recipe.data.max_length,
                 "dataloader_num_workers": 0},
        "training": {"strategy": "dspark", "max_steps": max_steps, "num_epochs": 1000,
                     "batch_size": min(per_rank, t.micro_batch),
                     "accumulation_steps": max(1, per_rank // t.micro_batch),
                     "learning_rate": r.lr, "warmup_ratio": min(1.0, warmup_steps / max_steps),
                     "max_grad_norm": r.clip_grad_norm,
                     "attention_backend": "sdpa", "num_anchors": o.num_anchors, "loss_decay_gamma": o.gamma_decay,
                     "dspark_ce_loss_alpha": o.ce_weight, "dspark_l1_loss_alpha": o.l1_weight,
                     "dspark_confidence_head_alpha": o.bce_weight, "fsdp_sharding": "NO_SHARD",
                     "save_interval": t.save_every or 20, "log_interval": 5, "seed": t.seed},
        "deployment": {"mode": "local_colocated", "trainer": {"nproc_per_node": nproc}},
        "output_dir": str(folder / "out"),
        "run_id": "sf",
    }
    path = folder / "specforge.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def specforge_checkpoints(out: Path) -> dict[int, Path]:
    """step -> checkpoint folder of a SpecForge run (complete ones: they hold a model file)."""
    found = {}
    for p in out.rglob("*step*"):
        digits = "".join(c for c in p.name.rsplit("step", 1)[-1] if c.isdigit())
        if p.is_dir() and digits and any(p.iterdir()):
            found[int(digits)] = p
    return found


def run_specforge(recipe, dcfg, target_dir: Path, samples: list, folder: Path, minutes: float, nproc: int,
                  capture_share: float, step_s: float, ours_step_s: float = 0.0,
                  dtype_name: str = "bfloat16") -> dict:
    from dspark_sgl.targets.hf import HFTarget
    from training.data import epoch_order

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.time()
    deadline = t0 + 60 * minutes
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(nproc)
    target = HFTarget.from_pretrained(target_dir, dcfg.target_layer_ids, dtype=dtype)
    order = [samples[i] for i in epoch_order(len(samples), recipe.train.seed, 0)]
    n = capture(target, order, folder / "features", t0 + 60 * minutes * capture_share, dtype)
    del target
    captured_s = time.time() - t0
    max_steps = max(1, int((deadline - time.time()) / step_s))
    from training.trainer import total_steps

    warmup = round(recipe.optim.warmup_ratio * total_steps(recipe, len(samples)))  # what ours uses, in steps
    if ours_step_s > 0:  # the same warmup in wall time: at 4x ours' step time, equal steps would be 4x the minutes
        warmup = max(1, round(warmup * ours_step_s / step_s))
    cfg = specforge_config(recipe, dcfg, target_dir, folder, max_steps, nproc, dtype_name, warmup)
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), str(BIN / "specforge"), "train", "-c", str(cfg),
           f"deployment.trainer.nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECFORGE_DEVICE": "cpu"}
    with open(folder / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None  # stopped by the budget
    if rc not in (None, 0):
        raise RuntimeError(f"specforge train failed (rc {rc}): see {folder / 'train.log'}")
    ckpts = {s: p.stat().st_mtime - t0 for s, p in specforge_checkpoints(folder / "out").items()
             if p.stat().st_mtime <= deadline + 5}
    step_times = re.findall(r"'perf/optimizer_step_time_s': ([0-9.]+)", (folder / "train.log").read_text())
    return {"step_s_logged": float(step_times[-1]) if step_times else None,
            "launched": t0, "wall_s": time.time() - t0, "capture_s": captured_s, "captured_samples": n,
            "planned_steps": max_steps, "warmup_steps": warmup, "finished_before_budget": rc == 0, "checkpoints": ckpts}


def export_specforge(folder: Path, step: int, out: Path) -> Path:
    ckpt = specforge_checkpoints(folder / "out")[step]
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "specforge"), "export", "--to", "hf", "--checkpoint", str(ckpt), "--draft-config",
           str(folder / "draft_config.json"), "--output-dir", str(out), "--embedding-source", "target"]
    with open(out.parent / f"export-{step}.log", "w") as log:
        subprocess.run(cmd, cwd=folder, env={**os.environ, "SPECFORGE_DEVICE": "cpu"}, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return out


# ---- selection, eval, report ---------------------------------------------------------------------------------
def pick(checkpoints: dict[int, float], minutes: float, points: int) -> list[int]:
    """The checkpoint steps nearest to `points` evenly spaced fractions of the budget (the last one always)."""
    if not checkpoints:
        return []
    steps = sorted(checkpoints)
    wanted = [minutes * 60 * (k + 1) / points for k in range(points - 1)]
    chosen = {min(steps, key=lambda s: abs(checkpoints[s] - w)) for w in wanted}
    chosen.add(steps[-1])
    return sorted(chosen)


def taus(eval_json: Path) -> dict[str, float]:
    ev = json.loads(eval_json.read_text())
    return {d["name"]: round(d["tau"], 4) for d in ev.get("dspark", ev)["datasets"]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETS), figsize=(4 * len(SETS), 3.2), sharey=True)
    for ax, name in zip(axes, SETS, strict=True):
        for trainer in sorted({r["trainer"] for r in rows}):
            pts = sorted((r["wall_s"] / 60, r["tau"][name]) for r in rows if r["trainer"] == trainer)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=trainer)
        ax.set_title(name)
        ax.set_xlim(0, max(r["minutes"] for r in rows) * 1.02)
        ax.set_xlabel("wall minutes from cold start")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("τ (T=0, held-out)")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(
    minutes: Annotated[float, typer.Option(help="Wall budget per trainer, from its launch.")],
    json_out: Annotated[Path, typer.Option(help="Result JSON.")],
    recipe: Annotated[Path, typer.Option(help="The recipe both follow.")] = RECIPE,
    set_: Annotated[list[str], typer.Option("--set", help="Recipe override key=value (repeatable).")] = [],  # noqa: B006
    data_cache: Annotated[Path, typer.Option(help="Samples prepared once for both (untimed).")] = Path(
        "runs/trainer_vs_specforge/data"),
    root: Annotated[Path, typer.Option()] = Path("runs/trainer_vs_specforge"),
    trainers: Annotated[str, typer.Option(help="Comma list of ours, specforge.")] = "ours,specforge",
    same_vocab: Annotated[bool, typer.Option(help="Train ours at the full vocabulary too (SpecForge's).")] = False,
    nproc: Annotated[int, typer.Option(min=1)] = 2,
    concurrent: Annotated[bool, typer.Option(
        help="Run the trainers at the same time on nproc/2 ranks each (a shared box's load hits both alike).")] = True,
    stage: Annotated[str, typer.Option(help="train (under the bench lock), eval (after it: τ needs no lock) or all."
                                       )] = "all",
    capture_share: Annotated[float, typer.Option(min=0.01, max=0.99)] = 0.25,
    specforge_step_s: Annotated[float, typer.Option(help="Seconds per SpecForge step (plans its LR cosine).")] = 2.0,
    ours_startup_s: Annotated[float, typer.Option(help="Launch-to-clock seconds taken off ours' LR budget.")] = 15.0,
    ours_step_s: Annotated[float, typer.Option(
        help="Seconds per step of ours (from a calibration run): SpecForge's warmup is then ours' in wall time, "
             "not in steps. 0: the same number of steps.")] = 0.0,
    points: Annotated[int, typer.Option(min=1)] = 3,
    prompts: Annotated[int, typer.Option(min=1)] = 20,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 96,
    eval_dir: Annotated[Path, typer.Option()] = EVAL_DIR,
    plot_out: Annotated[Path | None, typer.Option("--plot")] = None,
    note: Annotated[str, typer.Option()] = "",
) -> None:
    ours_over = list(set_) + (["draft.draft_vocab_size=null"] if same_vocab else [])
    rec, dcfg, target_dir = load(recipe, list(set_))
    full = dataclasses.replace(dcfg, draft_vocab_size=None)  # SpecForge: no d2t map, the full vocabulary
    full.require_full_vocab("SpecForge 0.2.0")
    samples = prepare_data(rec, target_dir, data_cache.resolve())
    root = root.resolve()
    rows = []
    state = root / "runs.json"
    runs = json.loads(state.read_text()) if state.exists() else {}
    names = trainers.split(",") if stage in ("train", "all") else []
    if unknown := set(names) - {"ours", "specforge"}:
        raise typer.BadParameter(f"unknown trainer(s) {sorted(unknown)} (ours, specforge)")
    each = max(1, nproc // len(names)) if concurrent and names else nproc

    def train(trainer: str) -> None:
        print(f"[{trainer}] training for {minutes:g} min on {each} rank(s)", flush=True)
        if trainer == "ours":
            runs[trainer] = run_ours(recipe.resolve(), ours_over, root / trainer, data_cache.resolve(), minutes, each,
                                     ours_startup_s)
        else:
            runs[trainer] = run_specforge(rec, full, target_dir, samples, root / trainer, minutes, each,
                                          capture_share, specforge_step_s, ours_step_s)
        runs[trainer]["ranks"] = each
        print(f"[{trainer}] {json.dumps({k: v for k, v in runs[trainer].items() if k != 'checkpoints'})}", flush=True)

    if concurrent:  # side by side: both see the same load on a shared box
        with ThreadPoolExecutor(len(names) or 1) as pool:
            for f in [pool.submit(train, n) for n in names]:
                f.result()
    else:
        for n in names:
            train(n)
    if names:
        state.write_text(json.dumps(runs, indent=1))  # JSON: step keys become strings
    if stage == "train":
        return
    runs = json.loads(json.dumps(runs))
    for run in runs.values():
        run["checkpoints"] = {int(k): v for k, v in run["checkpoints"].items()}
    for trainer, run in runs.items():
        folder = root / trainer
        for step in pick(run["checkpoints"], minutes, points):
            draft = folder / "drafts" / f"step-{step}"
            if trainer == "ours":
                export_ours(recipe.resolve(), ours_over, folder, step, draft)
            else:
                export_specforge(folder, step, draft)
            ev = draft.with_suffix(".eval.json")
            eval_draft(draft, ev, prompts, max_new_tokens, eval_dir.resolve(), folder / f"eval-{step}.log",
                       str(target_dir))
            rows.append({"trainer": trainer, "draft": str(draft), "minutes": minutes, "steps": step,
                         "wall_s": round(run["checkpoints"][step], 1), "tau": taus(ev),
                         "draft_vocab": (full if trainer == "specforge" or same_vocab else dcfg).draft_vocab})
    print("trainer | steps | wall min | " + " | ".join(f"τ {s}" for s in SETS))
    for r in rows:
        print(f"{r['trainer']} | {r['steps']} | {r['wall_s'] / 60:.1f} | "
              + " | ".join(f"{r['tau'].get(s, float('nan')):.3f}" for s in SETS))
    record = {"cpu": provenance()["cpu"],
              "provenance": provenance(recipe=str(recipe), overrides=list(set_), minutes=minutes, prompts=prompts,
                                       ours_startup_s=ours_startup_s,
                                       max_new_tokens=max_new_tokens, sets=SETS, nproc=nproc, same_vocab=same_vocab,
                                       capture_share=capture_share, specforge_step_s=specforge_step_s,
                                       ours_step_s=ours_step_s,
                                       concurrent=concurrent,
                                       samples=len(samples)),
              "note": note,
              "runs": {k: {kk: vv for kk, vv in v.items() if kk not in ("checkpoints", "launched")}
                       for k, v in runs.items()},
              "rows": rows}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_out}")
    if plot_out is not None:
        plot(rows, plot_out)
        print(f"wrote {plot_out}")


if __name__ == "__main__":
    typer.run(main)
