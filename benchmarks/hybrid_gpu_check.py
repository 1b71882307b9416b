"""GPU check: our DSPARK worker vs SGLang's builtin on a tiny KDA + MLA hybrid (K3 family), real kernels, CUDA.

Builds the tiny random Kimi-Linear of tests/sglang_cpu/tiny_hybrid.py (KDA layers 1, 2, 4, MLA layer 3; K3's own
class needs K3-only checkpoint pieces, Kimi-Linear shares its KDA/MLA state machinery), a bigram draft over the
target's own greedy outputs, and serves it three ways on one GPU with SGLang's real Triton KDA kernels:
plain, DSPARK builtin (SGLANG_PLUGINS=none) and DSPARK ours. Asserts, at T=0 in fp32 under the static schedule:
ours == plain token for token, ours == builtin, and per-request accept histograms ours == builtin. Prints a table
and writes JSON. Which commit path SGLang takes (scatter / fused-accept / ReplaySSM) follows the server flags:
pass e.g. `--extra --enable-linear-replayssm-spec` or `--extra --linear-attn-decode-backend flashinfer`.

  python benchmarks/hybrid_gpu_check.py --out benchmarks/results/hybrid_gpu_check.json   # needs a CUDA GPU + sglang

Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "sglang_cpu"))
from dspark_testkit import build_bigram_draft, free_port  # noqa: E402
from tiny_hybrid import HYBRID_SERVER_ENV, build_tiny_kimi_linear  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "List three primary colors: red,", "The quick brown fox", "Monday, Tuesday, Wednesday,",
           "1, 2, 3, 4, 5, 6,", "SELECT name, age FROM users WHERE", "Q: What is 12 plus 7?\nA:",
           "The largest planet in our solar system is"]
GPU_ARGS = ["--dtype", "float32", "--mem-fraction-static", "0.3", "--max-mamba-cache-size", "64",
            "--max-running-requests", "16", "--disable-cuda-graph"]


class GpuServer:
    def __init__(self, model: Path, args: list[str], env: dict[str, str], log: Path):
        self.port, self.log = free_port(), log
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *GPU_ARGS,
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     env={**os.environ, **env}, start_new_session=True)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(3)
        raise TimeoutError(log.read_text()[-3000:])

    def generate(self, ids: list[list[int]], max_new: int) -> list[dict]:
        body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
        self.proc.wait(timeout=60)


def serve(model, args, env, log, ids, max_new) -> list[dict]:
    s = GpuServer(model, args, env, log)
    try:
        return s.generate(ids, max_new)
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None, help="HF folder with SmolLM2's tokenizer + config.json")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="extra server flags for all three")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "hybrid_gpu_check.json")
    a = ap.parse_args()
    if a.tokenizer is None:
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir

        a.tokenizer = smollm2_hf_dir()
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="hybrid-gpu-"))
    target = build_tiny_kimi_linear(work / "target", a.tokenizer)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    ours_env = {"PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **HYBRID_SERVER_ENV,
                "SGLANG_RAGGED_VERIFY_MODE": "static"}
    builtin_env = {**ours_env, "SGLANG_PLUGINS": "none"}

    plain = serve(target, a.extra, ours_env, work / "plain.log", ids, a.max_new)
    draft = build_bigram_draft(target, [p + o["output_ids"] for p, o in zip(ids, plain, strict=True)],
                               work / "draft", block_size=a.gamma, target_layer_ids=[0, 1, 2])
    spec = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(a.gamma), *a.extra]
    builtin = serve(target, spec, builtin_env, work / "builtin.log", ids, a.max_new)
    ours = serve(target, spec, ours_env, work / "ours.log", ids, a.max_new)

    rows = []
    for i, (p, b, o) in enumerate(zip(plain, builtin, ours, strict=True)):
        rows.append({"prompt": i, "ours_eq_plain": o["output_ids"] == p["output_ids"],
                     "ours_eq_builtin": o["output_ids"] == b["output_ids"],
                     "accept_builtin": b["meta_info"].get("spec_correct_drafts_histogram"),
                     "accept_ours": o["meta_info"].get("spec_correct_drafts_histogram")})
    print(f"{'prompt':>6} {'ours==plain':>12} {'ours==builtin':>14}  accept hist builtin | ours")
    for r in rows:
        print(f"{r['prompt']:>6} {r['ours_eq_plain']!s:>12} {r['ours_eq_builtin']!s:>14}  "
              f"{r['accept_builtin']} | {r['accept_ours']}")
    ok = all(r["ours_eq_plain"] and r["ours_eq_builtin"] and r["accept_builtin"] == r["accept_ours"] for r in rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"extra_args": a.extra, "gamma": a.gamma, "rows": rows, "pass": ok}, indent=1))
    print(f"{'PASS' if ok else 'FAIL'}; logs in {work}; wrote {a.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
