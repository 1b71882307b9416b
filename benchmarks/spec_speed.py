"""Plain target greedy vs DSpark on the same prompts, in the same run: tokens/s ratio, τ, draft/verify split.

T = 0 token identity is checked on every prompt while measuring (a speed-up that changes the output is a bug).

    python benchmarks/spec_speed.py --draft DIR [--target smollm2] [--data ../shared/data/eval/gsm8k.jsonl]
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import read_prompts
from dspark_sgl.loading import encode_prompt, eos_ids, load_pair
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def run(engine: SpecEngine, prompts, max_new: int, eos, batch_size: int):
    gens, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        gens += engine.generate(prompts[i : i + batch_size], max_new, SamplingConfig(), eos)
    return gens, time.perf_counter() - t0


def main(
    draft: Annotated[str, typer.Option(help="Draft folder, or `random`.")] = "random",
    target: str = "smollm2",
    data: Annotated[list[Path] | None, typer.Option(help="Prompt files ({'turns': [...]} JSONL).")] = None,
    limit: int = 10,
    max_new_tokens: int = 64,
    batch_size: int = 1,
    dtype: str = "float32",
    threads: int = 0,
    json_out: Path = Path("out/bench/spec_speed.json"),
) -> None:
    if threads:
        torch.set_num_threads(threads)
    data = data or [DEFAULT_DATA / "gsm8k.jsonl", DEFAULT_DATA / "mt-bench.jsonl"]
    tgt, model, tok = load_pair(target, draft, dtype)
    eos = eos_ids(tok, tgt)
    plain, spec = SpecEngine(tgt), SpecEngine(tgt, model)
    rows = []
    for path in data:
        prompts = [encode_prompt(tok, t, chat=True) for t in read_prompts(path, limit)]
        run(plain, prompts[:1], 8, eos, 1)  # warm-up both paths
        run(spec, prompts[:1], 8, eos, 1)
        base, t_base = run(plain, prompts, max_new_tokens, eos, batch_size)
        sd, t_spec = run(spec, prompts, max_new_tokens, eos, batch_size)
        identical = sum(a.token_ids == b.token_ids for a, b in zip(base, sd, strict=True))
        n_base, n_spec = sum(len(g.token_ids) for g in base), sum(len(g.token_ids) for g in sd)
        steps = [c for g in sd for c in g.stats.accepted]
        rows.append({
            "dataset": path.stem, "prompts": len(prompts), "batch_size": batch_size,
            "plain_tok_s": n_base / t_base, "dspark_tok_s": n_spec / t_spec,
            "speedup": (n_spec / t_spec) / (n_base / t_base),
            "tau": 1 + sum(steps) / max(len(steps), 1),
            "draft_s": sum(g.stats.draft_s for g in sd), "verify_s": sum(g.stats.verify_s for g in sd),
            "identical": identical,
        })
    table = Table(title=f"spec_speed: {target} + {draft} ({dtype}, T=0, {max_new_tokens} new tokens)")
    cols = ("dataset", "prompts", "plain tok/s", "DSpark tok/s", "ratio", "τ", "draft s", "verify s", "T=0 identical")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["dataset"], str(r["prompts"]), f"{r['plain_tok_s']:.1f}", f"{r['dspark_tok_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['draft_s']:.1f}", f"{r['verify_s']:.1f}",
                      f"{r['identical']}/{r['prompts']}")
    Console(width=160).print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps({"target": target, "draft": draft, "dtype": dtype, "threads":
                                    torch.get_num_threads(), "rows": rows}, indent=2))
    bad = [r["dataset"] for r in rows if r["identical"] != r["prompts"] and dtype == "float32"]
    if bad:
        raise SystemExit(f"T=0 output differs from plain greedy decoding on {bad}: that is a bug, not noise (fp32)")


if __name__ == "__main__":
    typer.run(main)
