"""Real SGLang on one CPU at --tp-size 1 and 2: plain vs NGRAM vs DSPARK (ours), tok/s and T=0 identity.

Every server is the product command (`dspark serve ... --tp-size N`: gloo, one process per rank, each rank on its own
cores via SGLANG_CPU_OMP_THREADS_BIND). The target is a random fp32 Llama built here (testkit `build_tiny_target`:
4 heads, 2 KV heads, so it splits over 2 ranks; SmolLM2-135M's 9 heads and 3 KV heads do not), the prompts random
token ids, the draft the testkit's bigram oracle fitted to plain TP=1's own outputs on these prompts (an upper-bound
style draft: it shows the serving path's cost and agreement under TP, not a trained draft's speed). Identity is
against plain TP=1 one request at a time.

    python benchmarks/sglang_tp.py [--hidden 512 --layers 8 --vocab 512 --prompts 8 --max-new-tokens 64]

Writes benchmarks/results/sglang_tp.json (provenance: CPU, commit, date, command, inputs).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft, build_tiny_target  # noqa: E402
from sglang_speed import measure, row  # noqa: E402


def main(
    hidden: int = 512,
    layers: int = 8,
    vocab: int = 512,
    prompts: int = 8,
    max_new_tokens: int = 64,
    block_size: int = 7,
    concurrency: Annotated[list[int] | None, typer.Option(help="Requests in flight; repeatable (default 1 and 4).")]
    = None,
    tp: Annotated[list[int] | None, typer.Option(help="TP sizes; repeatable (default 1 and 2).")] = None,
    ngram_tokens: int = 8,
    work: Path = Path("out/bench/sglang_tp"),
    json_out: Path = Path("benchmarks/results/sglang_tp.json"),
) -> None:
    concurrencies, tps = concurrency or [1, 4], tp or [1, 2]
    work = work.resolve()  # `dspark serve` runs from another folder: hand it absolute paths
    target = build_tiny_target(work / "target", vocab=vocab, hidden=hidden, layers=layers)
    rng = random.Random(0)
    ids = [[rng.randrange(vocab - 1) for _ in range(rng.randrange(16, 48))] for _ in range(prompts)]
    sets = {"random": ids}

    def serve(n: int, *args: str, log: str) -> ServeCommand:
        return ServeCommand(target, serve_args=[*args, "--tp-size", str(n), "--max-running-requests", "8"],
                            log_path=Path(f"/tmp/dspark-bench-tp{n}-{log}.log"))

    runs, draft = {}, None
    for n in tps:
        with serve(n, "--no-draft", log="plain") as s:
            runs[(n, "plain")] = measure(s, sets, max_new_tokens, concurrencies)[0]
        if draft is None:  # the bigram oracle of the first TP size's plain outputs (TP=1 by default)
            outs = runs[(n, "plain")][("random", concurrencies[0])][0]
            seqs = [p + o["output_ids"] for p, o in zip(ids, outs, strict=True)]
            draft = build_bigram_draft(target, seqs, work / "bigram-draft", block_size=block_size)
        with serve(n, "--no-draft", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                   str(ngram_tokens), log="ngram") as s:
            runs[(n, "NGRAM")] = measure(s, sets, max_new_tokens, concurrencies)[0]
        with serve(n, "--draft", str(draft.resolve()), log="dspark") as s:
            runs[(n, "DSPARK ours")] = measure(s, sets, max_new_tokens, concurrencies)[0]
            info = s.get("/server_info")["internal_states"][0].get("dspark_info_record") or {}
            runs[(n, "DSPARK ours")]["schedule"] = info.get("schedule")

    reference = runs[(tps[0], "plain")][("random", concurrencies[0])][0]  # plain at the first TP, one at a time
    results = []
    for n in tps:
        for c in concurrencies:
            base = runs[(n, "plain")][("random", c)]
            for method in ("plain", "NGRAM", "DSPARK ours"):
                r = row(method, *runs[(n, method)][("random", c)], base, reference)
                results.append({"tp": n, "concurrency": c, **r})
    result = {
        "provenance": provenance(target=dict(hidden=hidden, layers=layers, vocab=vocab, heads=4, kv_heads=2),
                                 prompts=prompts, max_new_tokens=max_new_tokens, concurrency=concurrencies, tp=tps,
                                 block_size=block_size, ngram_tokens=ngram_tokens),
        "dtype": "float32", "draft": "testkit bigram oracle of plain TP=1's outputs",
        "dspark_schedule": runs[(tps[-1], "DSPARK ours")].get("schedule"),
        "identity_reference": f"plain TP={tps[0]}, one request at a time", "results": results,
    }
    table = Table(title=f"SGLang on CPU, fp32, T=0, random Llama (hidden {hidden}, {layers} layers, vocab {vocab}): "
                        f"{prompts} prompts x {max_new_tokens} new tokens")
    for col in ("TP", "conc.", "method", "tok/s", "vs plain (same TP)", "accept length", f"identical to TP={tps[0]}"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in results:
        acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        table.add_row(str(r["tp"]), str(r["concurrency"]), r["method"], f"{r['tok_s']:.1f}", f"{r['ratio']:.2f}x",
                      acc, f"{r['identical']}/{r['prompts']}")
    Console().print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    Console(stderr=True).print(f"wrote {json_out}")


if __name__ == "__main__":
    typer.run(main)
