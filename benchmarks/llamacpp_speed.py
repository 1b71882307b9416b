"""Plain llama.cpp vs llama.cpp + our DSpark draft, batch 1, CPU: tok/s, ratio to plain, accept length, identical count.

One `llama-server` per configuration (benchmarks/llamacpp/harness.py: same binary, threads, one slot, T=0, prompts as
token ids through the chat template), each run over the first N prompts of held-out GSM8K, HumanEval and MT-Bench:
  plain                       no speculation (the baseline every ratio is to)
  ngram-simple                llama.cpp's own draft-free speculation (the control for verify-path numerics)
  dspark <draft> p_min=0      our exported draft, γ = 7 drafts per block, confidence cut off
  dspark <draft> p_min=P*     the same with the `--spec-draft-p-min` P* tuned on 3 GSM8K training questions
for every `--draft` (default: two random drafts of the README recipe's shape, full vocabulary and K = 8192) and every
target GGUF (`q4_1`: the packaged SmolLM2 file; `f32`: llama.cpp's converter on the fp32 HF folder we train on).
Where a run's output differs from plain, the first divergent token and plain's top-2 logit gap there are recorded.
Time split: llama.cpp's own `dur(g)` (the draft's block decode) against the server's generation time (the rest is
the target's verify, the draft's context injection and sampling).

With --engines (default on), the same run continues on the same prompts (the same token ids, batch 1, T=0, the
first --draft) through our two other engines, each against its own plain decoding:
  reference  dspark_sgl's reference engine on the fp32 HF target (benchmarks/spec_speed.py's passes)
  sglang     real SGLang 0.5.23 served by `dspark serve`: plain, NGRAM (k = 4) and DSPARK, our worker
             (benchmarks/sglang_speed.py's passes; needs $DSPARK_SGL_VENV, .ci/install_sglang.sh)

  PYTHONPATH=$PWD nice -n 10 python benchmarks/llamacpp_speed.py [--draft runs/NAME/draft ...] [--prompts 10]
Writes benchmarks/results/llamacpp_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llamacpp import harness  # noqa: E402

SETS = ("gsm8k", "humaneval", "mt-bench")


def run_config(target: Path, spec: tuple[str, ...], prompts: dict[str, list[list[int]]], n: int, log: Path) -> dict:
    """Every prompt of every set through one server: per-prompt tokens, timings and the spec counters' deltas."""
    out = {}
    with harness.Server(target, spec, log=log) as server:
        for name, ids in prompts.items():
            out[name] = [server.complete(p, n) for p in ids]
        flat = [c for name in prompts for c in out[name]]
        deadline = time.time() + 10  # the server logs a request's statistics line after its response is sent
        while 0 < len(stats := server.spec_stats()) < len(flat) and time.time() < deadline:
            time.sleep(0.2)
    prev = {"calls_accept": 0, "acc_tokens": 0, "draft_ms": 0.0, "gen_tokens": 0}
    for c, s in zip(flat, stats if stats else [None] * len(flat), strict=True):
        c.spec = {k: (s[k] or 0) - prev[k] for k in prev} if s else None  # stats are cumulative over the server
        prev = {k: s[k] or 0 for k in prev} if s else prev
    return out


def summarize(runs: list, plain: list | None) -> dict:
    gen_ms = sum(c.timings["predicted_ms"] for c in runs)
    tokens = sum(c.timings["predicted_n"] for c in runs)
    row = {"prompts": len(runs), "tokens": tokens, "tok_s": 1e3 * tokens / gen_ms, "gen_ms": gen_ms,
           "tok_s_median": statistics.median(c.timings["predicted_per_second"] for c in runs)}
    specs = [c.spec for c in runs if c.spec]
    if specs:
        steps = sum(s["calls_accept"] for s in specs)
        row["accept_len"] = 1 + sum(s["acc_tokens"] for s in specs) / max(steps, 1)  # bonus token included
        row["draft_tokens"] = sum(s["gen_tokens"] for s in specs)
        row["accepted"] = sum(s["acc_tokens"] for s in specs)
        row["draft_ms"] = sum(s["draft_ms"] for s in specs)
        row["draft_share"] = row["draft_ms"] / gen_ms
    if plain is not None:
        row["identical"] = sum(c.tokens == p.tokens for c, p in zip(runs, plain, strict=True))
        row["divergences"] = [first_divergence(c.tokens, p.tokens) | {"prompt": i}
                              for i, (c, p) in enumerate(zip(runs, plain, strict=True)) if c.tokens != p.tokens]
    return row


def first_divergence(got: list[int], want: list[int]) -> dict:
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return {"index": i, "got": got[i] if i < len(got) else None, "plain": want[i] if i < len(want) else None}


def logit_gaps(target: Path, prompts: dict, results: dict, n: int, log: Path) -> None:
    """Plain llama.cpp's top-2 logit gap (log p1 - log p2 of its one-token decode) at each first divergence."""
    todo = [(row, d) for rows in results.values() for row in rows for d in row.get("divergences", [])]
    if not todo:
        return
    with harness.Server(target, log=log) as server:
        cache = {}
        for row, d in todo:
            key = (row["set"], d["prompt"])
            if key not in cache:
                cache[key] = server.complete(prompts[row["set"]][d["prompt"]], n, n_probs=2).probs
            probs = cache[key]
            if d["index"] < len(probs):
                top = probs[d["index"]]["top_logprobs"]
                d["plain_top2"] = [t["id"] for t in top]
                d["top2_logit_gap"] = top[0]["logprob"] - top[1]["logprob"]


def tune_p_min(target: Path, draft: Path, tokenizer, grid: list[float], n: int, tmp: Path) -> tuple[float, dict]:
    """Fastest p_min on 3 GSM8K training questions (not the held-out ones): {p_min: tok/s}."""
    ids = [harness.chat_ids(tokenizer, p) for p in harness.eval_prompts("gsm8k", 3, skip=harness.HELD_OUT_GSM8K)]
    speeds = {}
    for p in grid:
        runs = run_config(target, harness.dspark_args(draft, p_min=p), {"tune": ids}, n, tmp / f"tune-{p}.log")
        speeds[p] = summarize(runs["tune"], None)["tok_s"]
    return max(speeds, key=speeds.get), speeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="append", type=Path, help="draft folder(s); default: two random recipe drafts")
    ap.add_argument("--targets", default="q4_1,f32", help="comma list of q4_1 (packaged) and f32 (converted)")
    ap.add_argument("--prompts", type=int, default=10, help="first N prompts of each set")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--p-min-grid", default="0.3,0.5,0.7,0.9")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp_speed.json"))
    ap.add_argument("--engines", action=argparse.BooleanOptionalAction, default=True,
                    help="also our reference engine and real SGLang on the same prompts with the first draft")
    args = ap.parse_args()

    from dspark_sgl.loading import load_tokenizer
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    harness.binary("llama-server")
    record = harness.provenance() | {"prompts_per_set": args.prompts, "max_new_tokens": args.tokens, "batch": 1,
                                     "threads": 2, "sets": list(SETS), "results": [], "drafts": {}}
    tokenizer = load_tokenizer(smollm2_hf_dir())
    prompts = {s: [harness.chat_ids(tokenizer, p) for p in harness.eval_prompts(s, args.prompts)] for s in SETS}
    tmp = Path(tempfile.mkdtemp(prefix="llamacpp-speed-"))
    drafts = args.draft or [harness.recipe_draft(tmp / "random-full"),
                            harness.recipe_draft(tmp / "random-k8192", draft_vocab_size=8192)]
    for kind in args.targets.split(","):
        target = harness.target_gguf(kind)
        results = {}
        plain = run_config(target, (), prompts, args.tokens, tmp / f"{kind}-plain.log")
        configs = [("plain", (), plain), ("ngram-simple", harness.NGRAM_ARGS, None)]
        for d in drafts:
            gguf = harness.export(d, target, tmp / f"{d.name}-{kind}.gguf")
            label = f"{d.parent.name}/{d.name}" if d.name == "draft" else d.name
            cfg = json.loads((d / "config.json").read_text())
            record["drafts"].setdefault(label, {"folder": str(d), "draft_vocab_size": cfg.get("draft_vocab_size")})
            best, speeds = tune_p_min(target, gguf, tokenizer, [float(x) for x in args.p_min_grid.split(",")],
                                      args.tokens, tmp)
            record["drafts"][label][f"p_min_tuning_{kind}"] = speeds
            configs += [(f"dspark {label} p_min=0", harness.dspark_args(gguf), None),
                        (f"dspark {label} p_min={best}", harness.dspark_args(gguf, p_min=best), None)]
        for name, spec, done in configs:
            runs = done or run_config(target, spec, prompts, args.tokens, tmp / f"{kind}-{len(results)}.log")
            for s in SETS:
                row = summarize(runs[s], None if name == "plain" else plain[s])
                results.setdefault(s, []).append(row | {"target": kind, "config": name, "set": s})
        for rows in results.values():
            base = next(r for r in rows if r["config"] == "plain")
            for r in rows:
                r["ratio_to_plain"] = r["tok_s"] / base["tok_s"]
        logit_gaps(target, prompts, results, args.tokens, tmp / f"{kind}-gaps.log")
        record["results"] += [r for rows in results.values() for r in rows]
        print_table([r for rows in results.values() for r in rows], record)
    if args.engines:
        record["results"] += engine_rows(drafts[0], args.prompts, args.tokens, tmp)
        print_table(record["results"], record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def engine_rows(draft: Path, n: int, tokens: int, tmp: Path) -> list[dict]:
    """The same prompts (first n of each set, chat template, batch 1, T=0, `tokens` new) through our reference engine
    and real SGLang, as rows shaped like llama.cpp's: tok/s, ratio to the engine's own plain, accept length (bonus
    included), identical to that plain. Both benchmarks raise if an fp32 output differs where it must not."""
    from benchmarks import sglang_speed, spec_speed

    rows = []
    for s in SETS:
        out = tmp / f"reference-{s}.json"
        spec_speed.main(draft=[str(draft)], tau=[0.0], data=harness.DATA / f"{s}.jsonl", limit=n,
                        max_new_tokens=tokens, batch_size=[1], dtype=["float32"], json_out=out)
        for r in json.loads(out.read_text())["rows"]:
            plain = r["engine"] == "plain"
            rows.append({"target": "hf-fp32", "set": s, "config": f"reference {'plain' if plain else 'dspark'}",
                         "prompts": r["prompts"], "tokens": r["tokens"], "tok_s": r["tok_s"],
                         "ratio_to_plain": r["ratio"], "step_ms": r["step_ms"]}
                        | ({} if plain else {"accept_len": r["tau"], "identical": r["identical"]}))
    out = tmp / "sglang.json"
    sglang_speed.main(draft=str(draft), data=[harness.DATA / f"{s}.jsonl" for s in SETS], limit=n,
                      max_new_tokens=tokens, concurrency=[1], ngram_tokens=[4], builtin=False, json_out=out)
    for res in json.loads(out.read_text())["results"]:
        for r in res["rows"]:
            plain = r["method"] == "plain"
            rows.append({"target": "hf-fp32", "set": res["data"], "config": f"sglang {r['method']}",
                         "prompts": r["prompts"], "tok_s": r["tok_s"], "ratio_to_plain": r["ratio"]}
                        | ({} if plain else {"accept_len": r["accept_length"], "identical": r["identical"]}))
    return rows


def print_table(rows: list[dict], record: dict) -> None:
    print(f"\nllama.cpp {harness.VERSION} on {record['cpu']} ({record['cores']} cores, {record['box']}), batch 1, "
          f"T=0, {record['max_new_tokens']} tokens, {record['prompts_per_set']} prompts per set")
    head = f"{'target':6} {'set':9} {'config':44} {'tok/s':>7} {'ratio':>6} {'acc len':>7} {'same':>5} {'draft %':>7}"
    print(head + "\n" + "-" * len(head))
    for r in sorted(rows, key=lambda r: (r["target"], r["set"])):
        acc = f"{r['accept_len']:.2f}" if "accept_len" in r else "-"
        share = f"{100 * r['draft_share']:.0f}" if "draft_share" in r else "-"
        same = f"{r['identical']}/{r['prompts']}" if "identical" in r else "-"
        print(f"{r['target']:6} {r['set']:9} {r['config']:44} {r['tok_s']:7.1f} {r['ratio_to_plain']:6.2f} "
              f"{acc:>7} {same:>5} {share:>7}")


if __name__ == "__main__":
    main()
