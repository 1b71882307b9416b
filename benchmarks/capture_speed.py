"""Capture transports: MB/s of hidden-state rows for JSON lists vs the shared-memory ring vs a gloo pair, and the
per-token capture overhead over a plain prefill on a live SGLang engine.

  python benchmarks/capture_speed.py                 # transports only (torch), H=576 and a K3-shaped row
  python benchmarks/capture_speed.py --engine        # + SGLang 0.5.23 on CPU with SmolLM2 (needs the sglang venv)

Rows per sample are [n, W] in the model dtype: W = (K+1)·H. `json` is the path SGLang takes for
return_hidden_states (tensor -> .tolist() -> JSON text (orjson) -> parse -> tensor; SGLang also pickles the lists twice
between its processes, not counted here); `shm` is one copy into the trainer's ring plus the
trainer's read into its batch tensor; `gloo` is header + rows over a two-member gloo group on 127.0.0.1 between two
processes (the cross-host transport; NCCL on GPUs). Prints a table, writes benchmarks/results/capture_speed.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_sgl.provenance import provenance  # noqa: E402
from dspark_sgl.sglang.transport import PairReceiver, ShmRing, Writer, parse_rid, wait_sent, writer  # noqa: E402

SHAPES = {  # name: (K aux layers, H, dtype)
    "SmolLM2 H=576, K=3 (+last), fp32": (3, 576, torch.float32),
    "K3-shaped 6 x 7168, bf16": (5, 7168, torch.bfloat16),
}


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def json_path(rows: torch.Tensor) -> torch.Tensor:
    """tensor -> lists -> JSON -> lists -> tensor, with orjson when present (SGLang's HTTP server uses it)."""
    try:
        import orjson

        dumps, loads = orjson.dumps, orjson.loads
    except ImportError:
        dumps, loads = json.dumps, json.loads
    return torch.as_tensor(loads(dumps(rows.float().tolist())), dtype=rows.dtype)


def shm_path(ring: ShmRing, w: Writer, rows: torch.Tensor, out: torch.Tensor) -> None:
    nbytes = rows.numel() * rows.element_size()
    r = ring.alloc(0, 0, nbytes)
    w.deliver(r, rows)
    out.copy_(ring.view(r, nbytes).view(rows.dtype).view(rows.shape))  # the trainer's copy into its batch
    ring.free(0, 0)


def _gloo_sender(rid: str, n: int, width: int, dtype: torch.dtype, reps: int) -> None:
    torch.set_num_threads(1)
    rows = torch.randn(n, width).to(dtype)
    route = parse_rid(rid)
    for _ in range(reps):
        writer().deliver(route, rows)
    wait_sent(600)
    time.sleep(1.0)


def gloo_mb_s(n: int, width: int, dtype: torch.dtype, reps: int) -> float:
    rec = PairReceiver("127.0.0.1", 0, "gloo", timeout_s=120)
    route = rec.route(0, 0, 0)
    for _ in range(reps):
        rec.pairs[0].expect()
    p = mp.get_context("spawn").Process(target=_gloo_sender, args=(route.rid, n, width, dtype, reps + 1))
    p.start()
    got, t0 = 0, None
    while got < reps + 1:
        for a in rec.drain():
            if a.rows is None:
                raise RuntimeError(a.error)
            got += 1
            if got == 1:
                t0 = time.perf_counter()  # the first transfer pays the group's rendezvous
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    p.join()
    rec.close()
    return reps * n * width * dtype.itemsize / dt / 1e6


def transports(tokens: int, reps: int) -> list[dict]:
    rows_out = []
    for name, (k, h, dtype) in SHAPES.items():
        width = (k + 1) * h
        rows = torch.randn(tokens, width).to(dtype)
        mb = rows.numel() * rows.element_size() / 1e6
        out = torch.empty_like(rows)
        ring, w = ShmRing(ShmRing.region_bytes(int(mb * 1e6)) + 4096), Writer()
        try:
            t_shm = timed(lambda r=ring, w=w, x=rows, o=out: shm_path(r, w, x, o), reps)
        finally:
            ring.close()
        json_reps = 1 if width > 10_000 else reps  # tens of seconds per K3-shaped sample
        t_json = timed(lambda x=rows: json_path(x), json_reps)
        g = gloo_mb_s(tokens, width, dtype, reps)
        rows_out.append({"rows": name, "tokens": tokens, "bytes_per_token": width * dtype.itemsize,
                         "MB_per_sample": mb, "json_MB_s": mb / t_json, "shm_MB_s": mb / t_shm, "gloo_MB_s": g,
                         "json_ms_per_token": t_json / tokens * 1e3, "shm_ms_per_token": t_shm / tokens * 1e3,
                         "gloo_ms_per_token": mb / g / tokens * 1e3})
    return rows_out


# ---- the live engine -------------------------------------------------------------------------------------------
def engine_overhead(samples: int, tokens: int, reps: int) -> dict:
    import sglang

    from dspark_sgl.sglang.capture import capture, capture_to, engine_kwargs
    from dspark_sgl.sglang.engine import SGLANG_CPU_ARGS
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    layers, H = [1, 14, 27], 576
    t0 = time.time()
    engine = sglang.Engine(model_path=str(smollm2_hf_dir()), dtype="float32", **SGLANG_CPU_ARGS,
                           **engine_kwargs(layers))
    start_s = time.time() - t0
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 40000, (tokens,), generator=g).tolist() for _ in range(samples)]
    width, n_tok = (len(layers) + 1) * H, samples * tokens
    ring = ShmRing(samples * ShmRing.region_bytes(tokens * width * 4))
    rec = PairReceiver("127.0.0.1", 0, "gloo", timeout_s=300)
    attempt = [0]

    def plain():
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0})

    def via_json():
        capture(engine, ids, len(layers), H)

    def via_shm():
        attempt[0] += 1
        routes = [ring.alloc(k, attempt[0], tokens * width * 4) for k in range(samples)]
        capture_to(engine, ids, [r.rid for r in routes])
        for k in range(samples):
            ring.free(k, attempt[0])

    def via_gloo():
        attempt[0] += 1
        routes = [rec.route(0, k, attempt[0]) for k in range(samples)]
        capture_to(engine, ids, [r.rid for r in routes])
        got = 0
        while got < samples:
            arrived = rec.drain()
            if any(a.rows is None for a in arrived):
                raise RuntimeError([a.error for a in arrived])
            got += len(arrived)
            time.sleep(0.0005)

    paths = (("plain", plain), ("json", via_json), ("shm", via_shm), ("gloo", via_gloo))
    try:
        for _, fn in paths:  # warm every path once (the gloo pair's rendezvous included)
            fn()
        times: dict[str, list[float]] = {name: [] for name, _ in paths}
        for _ in range(reps):  # interleaved, so a noisy neighbour hits every path alike
            for name, fn in paths:
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        res = {name: statistics.median(v) for name, v in times.items()}
    finally:
        rec.close()
        ring.close()
        engine.shutdown()
    out = {"engine_start_s": start_s, "samples": samples, "tokens_per_sample": tokens, "H": H, "K": len(layers),
           "seconds": res}
    out["overhead_ms_per_token"] = {k: (res[k] - res["plain"]) / n_tok * 1e3 for k in ("json", "shm", "gloo")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="rows per sample for the transport table")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--engine", action="store_true", help="also measure a live SGLang engine (SmolLM2, CPU)")
    ap.add_argument("--engine-samples", type=int, default=4)
    ap.add_argument("--engine-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "capture_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"threads": 1, "cpu_count": os.cpu_count(), "transports": transports(args.tokens, args.reps)}
    print(f"\nhidden-state rows, {args.tokens} tokens per sample, median of {args.reps} (1 thread each side)")
    print("| rows | bytes/token | MB/sample | JSON MB/s | shm MB/s | gloo MB/s | JSON ms/tok | shm ms/tok | "
          "gloo ms/tok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["transports"]:
        print(f"| {r['rows']} | {r['bytes_per_token']:,} | {r['MB_per_sample']:.1f} | {r['json_MB_s']:.1f} | "
              f"{r['shm_MB_s']:.0f} | {r['gloo_MB_s']:.0f} | {r['json_ms_per_token']:.3f} | "
              f"{r['shm_ms_per_token']:.4f} | {r['gloo_ms_per_token']:.4f} |")
    if args.engine:
        e = engine_overhead(args.engine_samples, args.engine_tokens, args.reps)
        result["engine"] = e
        n = e["samples"] * e["tokens_per_sample"]
        print(f"\nSGLang 0.5.23 on CPU, SmolLM2 fp32, {e['samples']} x {e['tokens_per_sample']} tokens per call, "
              f"K={e['K']} aux + last, H={e['H']} (engine start {e['engine_start_s']:.0f}s)")
        print("| path | s per call | ms/token | overhead over plain prefill, ms/token |")
        print("|---|---|---|---|")
        for k, v in e["seconds"].items():
            over = e["overhead_ms_per_token"].get(k)
            print(f"| {k} | {v:.3f} | {v / n * 1e3:.3f} | {'' if over is None else f'{over:+.3f}'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance(**vars(args)), **result}
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
