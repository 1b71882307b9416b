"""The tensor data plane on a real SGLang 0.5.23 engine (CPU, SmolLM2, fp32), slow.

1. One `sglang.Engine`: the rows that the plugin's hook ships through the shm ring and through a gloo pair are the
   bytes of the JSON path's values (same engine, same samples), and the tagged replies carry no lists.
2. The trainer with a colocated SGLang engine over transport.kind=shm trains like the in-process `hf` engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import REPO, cpu_env  # noqa: E402

from tests.conftest import require  # noqa: E402

LAYERS = [1, 14, 27]

SCRIPT = """
import sys, time, torch, sglang
from dspark_sgl.sglang.capture import capture, capture_to, engine_kwargs
from dspark_sgl.sglang.engine import SGLANG_CPU_ARGS
from dspark_sgl.sglang.transport import PairReceiver, ShmRing

def main():
    target, out, layers = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    engine = sglang.Engine(model_path=target, dtype="float32", **SGLANG_CPU_ARGS, **engine_kwargs(layers))
    try:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (37, 5, 64)]
        width = (len(layers) + 1) * 576
        ref = [torch.cat([c.aux, c.last], 1) for c in capture(engine, ids, len(layers), 576)]
        ring = ShmRing(1 << 24)
        routes = [ring.alloc(k, 0, len(x) * width * 4) for k, x in enumerate(ids)]
        capture_to(engine, ids, [r.rid for r in routes])
        shm = [ring.view(r, len(x) * width * 4).view(torch.float32).view(len(x), width).clone()
               for r, x in zip(routes, ids)]
        rec = PairReceiver("127.0.0.1", 0, "gloo", timeout_s=120)
        capture_to(engine, ids, [rec.route(0, k, 0).rid for k in range(len(ids))])
        got, deadline = {}, time.time() + 120
        while len(got) < len(ids) and time.time() < deadline:
            for a in rec.drain():
                assert a.rows is not None, a.error
                got[a.key] = a.rows
            time.sleep(0.01)
        torch.save({"ref": ref, "shm": shm, "gloo": [got[k] for k in range(len(ids))]}, out)
        ring.close()
    finally:
        engine.shutdown()

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def sgl_python() -> Path:
    return require("sglang")  # probed here, not at import: the fast tests must not pay for it


def sgl_env() -> dict[str, str]:
    return cpu_env({"PYTHONPATH": f"{REPO}{os.pathsep}{cpu_env()['PYTHONPATH']}"})


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(1200)  # its probe may take 900 s
def test_shm_and_gloo_rows_are_the_json_paths_bytes(sgl_python, smollm2_dir, tmp_path):
    script, out = tmp_path / "probe.py", tmp_path / "rows.pt"
    script.write_text(SCRIPT)
    res = subprocess.run([str(sgl_python), str(script), str(smollm2_dir), str(out), repr(LAYERS)], cwd=REPO,
                         env=sgl_env(), capture_output=True, text=True, timeout=900, start_new_session=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = torch.load(out)
    for name in ("shm", "gloo"):
        for ref, got in zip(rows["ref"], rows[name], strict=True):
            assert got.dtype == torch.float32 and got.shape == ref.shape
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"{name} rows differ from JSON's"
    print(f"\nshm and gloo rows == JSON rows bit for bit ({[tuple(r.shape) for r in rows['ref']]})")


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(2100)  # two training runs of <= 900 s each
def test_trainer_over_shm_trains_like_the_hf_engine(sgl_python, smollm2_dir, tmp_path):
    from safetensors.torch import load_file

    from tests.test_sglang_capture import _recipe
    from training.tiny import tiny_conversations

    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(8)))
    runs = {}
    for name, engine in (("hf", {"kind": "hf", "placement": "inprocess"}),
                         ("shm", {"kind": "sglang", "placement": "colocated"})):
        recipe = _recipe(tmp_path / name, smollm2_dir, data, {}, **engine)
        overrides = ["transport.kind=shm"] if name == "shm" else []
        t0 = time.time()
        res = subprocess.run([str(sgl_python), "-m", "training", "--config", str(recipe), *overrides], cwd=REPO,
                             env=sgl_env(), capture_output=True, text=True, timeout=900)
        log = tmp_path / name / "run" / "logs" / "engine-0.log"
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:] + (log.read_text()[-3000:]
                                                                             if log.exists() else "")
        print(f"\n{name}: 2 steps in {time.time() - t0:.0f}s")
        runs[name] = load_file(str(tmp_path / name / "run" / "draft" / "model.safetensors"))
        if name == "shm":
            ledger = [ln for ln in res.stdout.splitlines() if ln.startswith("[stream] ledger")]
            print(ledger[0])
            assert ledger and " 0 more than once" in ledger[0] and "4 keys delivered" in ledger[0]
    diff = max(float((runs["shm"][k] - runs["hf"][k]).abs().max()) for k in runs["hf"])
    print(f"draft weights after 2 steps: sglang over shm vs hf in-process max |Δ| {diff:.2e}")
    assert diff < 1e-4
