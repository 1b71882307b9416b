"""Is llama.cpp's F32 target batch-size invariant? The same position's next-token distribution from a single-token
decode and from a batched evaluation of the last `rows` tokens (what a speculative verify runs), no draft at all.

Issue 43, item 5: a DSpark run through llama.cpp (`-md OUR.gguf --spec-type draft-dspark`) left plain `llama-cli`'s
output at about token 90 of one prompt of five, at a near-tie. A verify evaluates γ + 1 = 8 rows in one batch, where
this build's F32 matmul takes llamafile's tinyBLAS (n >= 2 rows); a plain decode is one row (ggml's vec_dot). If the
two give different logits, a near-tie can flip with no error in the draft, its export or llama.cpp's verify.

For each prompt: one plain F32 llama-server (benchmarks/llamacpp/harness.py, one slot, T = 0) decodes `--tokens`
tokens with `n_probs` (entry t >= 1 comes from a single-token decode of token t - 1). Then for each step t >= rows:
cache the prefix up to t - rows (`cache_prompt`, `n_predict` 0), send the prefix up to t (the server evaluates exactly
the last `rows` tokens as one batch: `timings.prompt_n` is checked) and read the next-token distribution. Reported per
step: the argmax of each path, the top-1 log-probability difference, and the single path's top-2 gap; a flip is a step
where the argmaxes differ. Prompts: our own (lists and tables that repeat) and the first held-out GSM8K prompts.

    python benchmarks/llamacpp_batch_invariance.py --out benchmarks/results/llamacpp_batch_invariance.json
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent / "llamacpp"))
import harness  # noqa: E402

from dspark_sgl.provenance import provenance  # noqa: E402

OWN_PROMPTS = [
    "List the numbers from 1 to 30, one per line, each followed by its square.",
    "Write a multiplication table for 7, from 7 x 1 to 7 x 15, one line each.",
    "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' ten times, numbering each line.",
    "Write a Python function that returns the first n Fibonacci numbers, then call it for n = 1 to 10.",
    "Make a table of the days of the week with their number of letters, then do the same for the months.",
]
console = Console(stderr=True)


def scan(server: harness.Server, ids: list[int], tokens: int, rows: int) -> dict:
    """Every step t >= rows of one prompt's plain decode: single-token vs batched next-token top 2."""
    plain = server.complete(ids, tokens, n_probs=2)
    steps = []
    for t in range(rows, len(plain.tokens)):
        single = harness.top_logprobs(plain.probs[t])
        batched = server.batched_top(ids + plain.tokens[:t], rows)
        steps.append({"t": t, "single": single, "batched": batched, "flip": single[0][0] != batched[0][0],
                      "top1_logprob_diff": abs(single[0][1] - batched[0][1]) if single[0][0] == batched[0][0]
                      else None, "single_gap": single[0][1] - single[1][1]})
    return {"tokens": plain.tokens, "steps": steps}


def add_reference(results: list[dict], ids: list[list[int]], target_dir) -> None:
    """Which path is nearer the exact fp32 model: transformers' SmolLM2 fp32 log-probability of each step's top-1
    token (one forward over prompt + decoded tokens), and each path's largest distance from it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for r, prompt in zip(results, ids, strict=True):
        seq = prompt + r["detail"]["tokens"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
        single, batched = [], []
        for s in r["detail"]["steps"]:
            ref = logp[len(prompt) + s["t"] - 1]  # the distribution of decoded token t
            single.append(abs(float(ref[s["single"][0][0]]) - s["single"][0][1]))
            batched.append(abs(float(ref[s["batched"][0][0]]) - s["batched"][0][1]))
        r["max_abs_vs_fp32_reference"] = {"single": max(single, default=0.0), "batched": max(batched, default=0.0)}


def main(
    tokens: Annotated[int, typer.Option(help="Tokens decoded per prompt.")] = 96,
    rows: Annotated[int, typer.Option(help="Rows of the batched evaluation (a verify's γ + 1).")] = 8,
    gsm8k: Annotated[int, typer.Option(help="Held-out GSM8K prompts after our own.")] = 5,
    cache_type: Annotated[str, typer.Option(help="llama.cpp's KV cache type (-ctk/-ctv): f16 (its default) or "
                                                 "f32.")] = "f16",
    out: Path = Path("out/bench/llamacpp_batch_invariance.json"),
    reuse: Annotated[Path | None, typer.Option(help="Take the scans from this earlier result file (same prompts and "
                                                   "settings) and only recompute the fp32 reference.")] = None,
) -> None:
    from transformers import AutoTokenizer

    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    prompts = [("own", p) for p in OWN_PROMPTS] + [("gsm8k", p) for p in harness.eval_prompts("gsm8k", gsm8k)]
    ids = [harness.chat_ids(tok, text) for _, text in prompts]
    earlier = None if reuse is None else [r["detail"] for r in json.loads(reuse.read_text())["prompts"]]
    if earlier is not None and len(earlier) != len(prompts):
        raise typer.BadParameter(f"{reuse} holds {len(earlier)} prompts, this run has {len(prompts)}")
    results = []
    kv = ("-ctk", cache_type, "-ctv", cache_type)
    with harness.Server(harness.target_gguf("f32"), kv, verbosity=1) if earlier is None else nullcontext() as server:
        for i, (source, text) in enumerate(prompts):
            r = scan(server, ids[i], tokens, rows) if earlier is None else earlier[i]
            flips = [s for s in r["steps"] if s["flip"]]
            diffs = [s["top1_logprob_diff"] for s in r["steps"] if s["top1_logprob_diff"] is not None]
            row = {"source": source, "prompt": text if source == "own" else None, "steps": len(r["steps"]),
                   "flips": [{"t": s["t"], "single": s["single"], "batched": s["batched"]} for s in flips],
                   "max_top1_logprob_diff": max(diffs, default=0.0),
                   "steps_with_any_diff": sum(d > 0 for d in diffs), "detail": r}
            results.append(row)
            console.print(f"{source}: {len(flips)} flips in {len(r['steps'])} steps, max |Δ top-1 logprob| "
                          f"{row['max_top1_logprob_diff']:.2e}, {row['steps_with_any_diff']} steps differ at all")
    add_reference(results, ids, smollm2_hf_dir())
    record = {"provenance": provenance(tokens=tokens, rows=rows, gsm8k=gsm8k, llama_cpp=harness.VERSION,
                                       scans_reused_from=None if reuse is None else str(reuse), kv_cache=cache_type,
                                       target="SmolLM2-135M-Instruct F32 GGUF (llama.cpp's converter)"),
              "prompts": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    t = Table(title=f"llama.cpp {harness.VERSION} F32, {cache_type} KV cache: single-token decode vs a batch of {rows} "
                    "rows, T = 0")
    for col in ("prompt", "steps", "steps differing", "max |Δ top-1 logprob|", "single vs fp32", "batched vs fp32",
                "argmax flips (t: single -> batched, single gap)"):
        t.add_column(col)
    for i, r in enumerate(results):
        flips = "; ".join(f"{f['t']}: {f['single'][0][0]}->{f['batched'][0][0]} "
                          f"({f['single'][0][1] - f['single'][1][1]:.1e})" for f in r["flips"]) or "-"
        ref = r["max_abs_vs_fp32_reference"]
        t.add_row(f"{r['source']} {i}", str(r["steps"]), str(r["steps_with_any_diff"]),
                  f"{r['max_top1_logprob_diff']:.2e}", f"{ref['single']:.2e}", f"{ref['batched']:.2e}", flips)
    Console().print(t)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
