"""Static vs confidence-scheduled verification under simulated concurrency (R = 1..64 requests).

1. Measure the target's verify SPS table on this machine (or load one).
2. Run the real engine (static, full window) over prompts and record every step's confidence logits and accepted
   length - real draft/target behaviour.
3. For each R, draw R recorded steps per simulated engine step (many times) and compare
   static:     every request verifies γ+1 tokens; tokens = Σ(c+1);            step time = 1 / SPS(R·(γ+1))
   confidence: Algorithm 1 picks L_r;  tokens = Σ(min(c, L_r − 1) + 1);      step time = 1 / SPS(Σ L_r)
   (a capped request keeps the prefix it would have accepted anyway: acceptance is prefix-closed).

    python benchmarks/schedule.py --draft DIR [--target smollm2] [--sps out/sps.json]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import confidence_pairs, evaluate_dataset
from dspark_sgl.loading import eos_ids, load_pair
from dspark_sgl.provenance import provenance
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine, profile_target_sps
from dspark_sgl.speculative.scheduler import schedule
from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.sts import apply_sts

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def simulate(logits, accepted, temps, sps: SpsTable, R: int, gamma: int, trials: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"static": [0.0, 0.0], "confidence": [0.0, 0.0]}  # [tokens, seconds]
    for _ in range(trials):
        idx = torch.randint(0, len(accepted), (R,), generator=g)
        c, conf = accepted[idx], apply_sts(logits[idx].double(), temps)
        out["static"][0] += float((c + 1).sum())
        out["static"][1] += 1.0 / sps(R * (gamma + 1))
        L = schedule(conf, sps, "confidence")
        out["confidence"][0] += float((torch.minimum(c, L - 1) + 1).sum())
        out["confidence"][1] += 1.0 / sps(int(L.sum()))
    return {k: {"throughput": t / s, "per_request": t / s / R, "tau": t / (trials * R)} for k, (t, s) in out.items()}


def main(
    draft: str = "random",
    target: str = "smollm2",
    data: Annotated[list[Path] | None, typer.Option()] = None,
    limit: int = 10,
    max_new_tokens: int = 64,
    sps: Annotated[Path | None, typer.Option(help="SPS table JSON (default: profile now).")] = None,
    max_requests: int = 64,
    trials: int = 200,
    threads: int = 0,
    json_out: Path = Path("out/bench/schedule.json"),
) -> None:
    if threads:
        torch.set_num_threads(threads)
    tgt, model, tok = load_pair(target, draft, "float32")
    gamma = model.config.block_size
    table = SpsTable.load(sps) if sps else profile_target_sps(tgt, max_requests * (gamma + 1), repeats=2)
    engine = SpecEngine(tgt, model)
    gens = []
    for path in data or [DEFAULT_DATA / "gsm8k.jsonl"]:
        gens += evaluate_dataset(engine, tok, path, limit, max_new_tokens, SamplingConfig(), eos_ids(tok, tgt))[1]
    logits, accepted = confidence_pairs(gens)
    temps = None if model.config.sts_temperatures is None else torch.tensor(model.config.sts_temperatures)
    rows = []
    for R in (1, 2, 4, 8, 16, 32, 64):
        if R > max_requests:
            break
        rows.append({"R": R, **simulate(logits, accepted, temps, table, R, gamma, trials)})
    t = Table(title=f"static vs confidence schedule ({len(accepted)} recorded steps, γ={gamma}, SPS measured)")
    for col in ("R", "static tok/s", "conf tok/s", "gain", "static per-req", "conf per-req", "τ static", "τ conf"):
        t.add_column(col, justify="right")
    for r in rows:
        s, c = r["static"], r["confidence"]
        t.add_row(str(r["R"]), f"{s['throughput']:.1f}", f"{c['throughput']:.1f}",
                  f"{c['throughput'] / s['throughput']:.2f}x", f"{s['per_request']:.1f}", f"{c['per_request']:.1f}",
                  f"{s['tau']:.2f}", f"{c['tau']:.2f}")
    Console(width=160).print(t)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(draft=str(draft), target=str(target)), "draft": draft, "target": target,
              "sps": table.to_dict(), "rows": rows}
    json_out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    typer.run(main)
