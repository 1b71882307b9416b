"""Hidden-state capture for training from a stock SGLang 0.5.23 engine (dspark_sgl.sglang.capture).

Fast tests (default suite, no SGLang): how returned rows are split and validated, the HTTP client, the trainer's
sglang capture adapter against a fake server, the recipe checks. Slow tests (real SGLang on CPU, fp32, SmolLM2):
the served capture equals HFTarget's over samples sharing a prefix (HTTP and in-process sglang.Engine), a layer id
beyond the target stops start-up with one error, and the trainer's `sglang` engine trains like the `hf` engine.

Run the slow ones: `pytest -m slow tests/test_sglang_capture.py` (SGLang venv at $DSPARK_SGL_VENV, default
/work/sgl-venv, as for tests/test_sglang_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from dspark_sgl.sglang.capture import (
    OVERRIDE_KEY,
    CaptureError,
    capture,
    engine_kwargs,
    prompt_rows,
    server_args,
    split_rows,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import REPO, Server, cpu_env  # noqa: E402

from tests.conftest import require  # noqa: E402

K, H = 2, 4


def rows_for(ids: list[int], k: int = K, h: int = H) -> list[list[float]]:
    """Fake server rows: aux j of token t = 100·t + j, last = -t (so a mix-up shows)."""
    return [[100.0 * t + j // h for j in range(k * h)] + [-float(t)] * h for t in range(len(ids))]


# ---- splitting and validation (no SGLang) ----------------------------------------------------------------------
def test_split_rows_separates_aux_and_last():
    got = split_rows(rows_for([5, 6, 7]), 3, K, H)
    assert got.aux.shape == (3, K * H) and got.last.shape == (3, H)
    assert got.aux[2, H].item() == 201.0 and got.last[2, 0].item() == -2.0


@pytest.mark.parametrize(
    ("rows", "n", "message"),
    [
        (rows_for([1, 2]), 3, "shape \\(2, 12\\) for a 3-token.*--disable-radix-cache --chunked-prefill-size -1"),
        ([r[: K * H] for r in rows_for([1, 2, 3])], 3, "aux only.*dspark_capture_last_hidden"),
        ([r + [0.0] for r in rows_for([1, 2])], 2, "expected \\(2, 12\\) = \\(K\\+1\\)·H with K=2"),
        ([1.0, 2.0], 2, "shape \\(2,\\)"),
    ],
)
def test_split_rows_rejects_wrong_shapes_with_one_error(rows, n, message):
    with pytest.raises(CaptureError, match=message):
        split_rows(rows, n, K, H)


def test_prompt_rows_joins_prefill_chunks_and_drops_decode_rows():
    hs = [[[1.0, 1.0], [2.0, 2.0]], [[3.0, 3.0]], [4.0, 4.0]]  # two prefill chunks, then one decode row
    assert prompt_rows(hs) == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


class FakeEngine:
    """An in-process engine stand-in with sglang.Engine.generate's signature and reply layout."""

    def __init__(self, drop_rows: int = 0, hidden: bool = True):
        self.drop_rows, self.hidden, self.calls = drop_rows, hidden, []

    def generate(self, input_ids, sampling_params, return_hidden_states):
        self.calls.append((input_ids, sampling_params, return_hidden_states))
        meta = lambda ids: {"hidden_states": [rows_for(ids)[self.drop_rows:], [0.0] * (K + 1) * H]} if self.hidden \
            else {}
        return [{"output_ids": [0], "meta_info": meta(ids)} for ids in input_ids]


def test_capture_sends_prefill_only_requests_and_splits_each_sample():
    engine = FakeEngine()
    got = capture(engine, [[1, 2, 3], [4, 5]], K, H)
    ids, params, hidden = engine.calls[0]
    assert ids == [[1, 2, 3], [4, 5]] and params["max_new_tokens"] == 1 and hidden is True
    assert [c.aux.shape[0] for c in got] == [3, 2]
    assert got[0].last[:, 0].tolist() == [0.0, -1.0, -2.0]


def test_capture_errors_name_the_missing_server_setting():
    with pytest.raises(CaptureError, match="returned no hidden states.*--enable-return-aux-hidden-states"):
        capture(FakeEngine(hidden=False), [[1, 2]], K, H)
    with pytest.raises(CaptureError, match="fewer rows"):
        capture(FakeEngine(drop_rows=1), [[1, 2, 3]], K, H)
    with pytest.raises(CaptureError, match="no empty sample"):
        capture(FakeEngine(), [[1], []], K, H)


def test_server_flags_and_engine_kwargs_say_the_same():
    flags = server_args([1, 14, 27])
    kw = engine_kwargs([1, 14, 27])
    assert flags[flags.index("--return-aux-hidden-state-layer-ids") + 1:][:3] == ["1", "14", "27"]
    assert kw["return_aux_hidden_state_layer_ids"] == [1, 14, 27]
    assert json.loads(kw["json_model_override_args"]) == {OVERRIDE_KEY: True}
    for name, value in kw.items():
        flag = "--" + name.replace("_", "-")
        assert flag in flags, flag
        if isinstance(value, str | int) and not isinstance(value, bool):
            assert flags[flags.index(flag) + 1] == str(value)


@pytest.fixture
def fake_http_server():
    """/generate answering like a capture server (batched input_ids -> a list of replies)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = [{"meta_info": {"hidden_states": [rows_for(ids)]}} for ids in body["input_ids"]]
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_trainer_adapter_pads_http_captures_back_to_the_batch(fake_http_server):

    from dspark_sgl.sglang.engine import SGLangCapture

    cap = SGLangCapture(K, H, url=fake_http_server)
    ids = torch.tensor([[7, 8, 9], [4, 5, 0]])
    out = cap(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert out.aux.shape == (2, 3, K * H) and out.last_hidden.shape == (2, 3, H)
    assert out.last_hidden[0, :, 0].tolist() == [0.0, -1.0, -2.0]
    assert out.aux[1, 2].abs().sum() == 0 and out.aux[1, 1, 0] == 100.0  # padding stays zero


def test_recipe_rejects_sglang_in_process_and_a_non_http_url():
    from training.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="engine.kind=sglang runs in an engine process"):
        load_recipe(None, ["engine.kind=sglang"])
    with pytest.raises(RecipeError, match="engine.sglang_url must be http"):
        load_recipe(None, ["engine.kind=sglang", "engine.placement=colocated", "engine.sglang_url=tcp://x:1"])
    with pytest.raises(RecipeError, match="engine.sglang_args: Input should be a valid dictionary"):
        load_recipe(None, ["engine.kind=sglang", "engine.placement=colocated", "engine.sglang_args=[1]"])


# ---- real SGLang on CPU ----------------------------------------------------------------------------------------
LAYERS = [1, 14, 27]


@pytest.fixture(scope="module")
def sgl_python() -> Path:
    return require("sglang")  # probed here, not at import: the fast tests must not pay for it


@pytest.fixture(scope="module")
def target_dir(sgl_python, smollm2_dir) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def samples(target_dir) -> list[list[int]]:
    """Three samples; the first two share a 9-token prefix (a radix cache would skip it in the second)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    a = tok("The capital of France is Paris, and the capital of Italy is Rome.")["input_ids"]
    b = a[:9] + tok(" Spain is a country in the south of Europe")["input_ids"]
    c = tok("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")["input_ids"]
    return [a, b, c]


def assert_matches_hf(target_dir: Path, samples: list[list[int]], got) -> tuple[float, float]:
    from dspark_sgl.targets.hf import HFTarget

    ref = HFTarget.from_pretrained(target_dir, LAYERS)
    worst_aux = worst_last = 0.0
    for ids, c in zip(samples, got, strict=True):
        r = ref.capture(torch.tensor([ids]))
        assert c.aux.shape == (len(ids), len(LAYERS) * 576) and c.last.shape == (len(ids), 576)
        torch.testing.assert_close(c.aux, r.aux[0], rtol=1e-4, atol=1e-2)
        torch.testing.assert_close(c.last, r.last_hidden[0], rtol=1e-4, atol=1e-3)
        worst_aux = max(worst_aux, float((c.aux - r.aux[0]).abs().max()))
        worst_last = max(worst_last, float((c.last - r.last_hidden[0]).abs().max()))
    return worst_aux, worst_last


def plain_vs_capture_seconds(server: Server, ids: list[int]) -> tuple[float, float]:
    plain = {"input_ids": [ids], "sampling_params": {"max_new_tokens": 1}}
    t0 = time.perf_counter()
    server.post("/generate", plain)
    t1 = time.perf_counter()
    capture(server.url, [ids], len(LAYERS), 576)
    return t1 - t0, time.perf_counter() - t1


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(900)  # a server start of <= 600 s
def test_http_capture_equals_hf_target_with_shared_prefixes(target_dir, samples):
    long = list(range(1000, 1512))
    with Server(target_dir, server_args(LAYERS)) as s:  # stopped right after: an idle server burns a core
        together = capture(s.url, samples, len(LAYERS), 576)  # one batch: a and b share a prefix
        alone = capture(s.url, [samples[1]], len(LAYERS), 576)  # b again, after a was served
        plain_vs_capture_seconds(s, long)  # warm
        plain, captured = plain_vs_capture_seconds(s, long)
    worst = assert_matches_hf(target_dir, samples + [samples[1]], together + alone)
    print(f"\nHTTP capture vs HFTarget (fp32): max |Δaux| {worst[0]:.2e}, max |Δlast| {worst[1]:.2e}")
    print(f"512-token prefill: plain {plain:.2f}s, with capture {captured:.2f}s (+{(captured - plain) / 512e-3:.2f} "
          f"ms/token for {(len(LAYERS) + 1) * 576} floats/token as JSON lists)")


ENGINE_SCRIPT = """
import sys, torch, sglang
from dspark_sgl.sglang.capture import capture, engine_kwargs
from dspark_sgl.sglang.engine import SGLANG_CPU_ARGS
target, out, layers, samples = sys.argv[1], sys.argv[2], eval(sys.argv[3]), eval(sys.argv[4])
engine = sglang.Engine(model_path=target, dtype="float32", **SGLANG_CPU_ARGS, **engine_kwargs(layers))
try:
    got = capture(engine, samples, len(layers), 576)
    torch.save([(c.aux, c.last) for c in got], out)
finally:
    engine.shutdown()
"""


@pytest.mark.slow
@pytest.mark.sglang
def test_engine_api_capture_equals_hf_target(sgl_python, target_dir, samples, tmp_path):
    from dspark_sgl.sglang.capture import Captured

    out = tmp_path / "captured.pt"
    res = subprocess.run([str(sgl_python), "-c", ENGINE_SCRIPT, str(target_dir), str(out), repr(LAYERS),
                          repr(samples)], cwd=REPO, env=cpu_env({"PYTHONPATH": f"{REPO}{os.pathsep}"
                                                                 f"{cpu_env()['PYTHONPATH']}"}),
                         capture_output=True, text=True, timeout=400, start_new_session=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = [Captured(a, last) for a, last in torch.load(out)]
    worst = assert_matches_hf(target_dir, samples, got)
    print(f"\nsglang.Engine capture vs HFTarget (fp32): max |Δaux| {worst[0]:.2e}, max |Δlast| {worst[1]:.2e}")


@pytest.mark.slow
@pytest.mark.sglang
def test_layer_beyond_the_target_stops_startup_with_one_error(target_dir):
    code, out = Server(target_dir, server_args([1, 30])).run_to_exit(timeout=480)
    assert code != 0
    assert "--return-aux-hidden-state-layer-ids [30] out of range for a target with 30 layers." in out


@pytest.mark.slow
@pytest.mark.sglang
def test_override_without_aux_capture_stops_startup_with_our_error(target_dir):
    override = ["--json-model-override-args", json.dumps({OVERRIDE_KEY: True})]
    code, out = Server(target_dir, override).run_to_exit(timeout=480)
    assert code != 0
    assert f"{OVERRIDE_KEY!r} appends the post-norm hidden to aux captures" in out


# ---- the trainer's sglang engine -------------------------------------------------------------------------------
def _recipe(folder: Path, target_dir: Path, data: Path, optim: dict, **engine) -> Path:
    recipe = {
        "target": {"path": str(target_dir), "dtype": "float32"},
        "draft": {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                  "intermediate_size": 128, "block_size": 4, "mask_token_id": 16, "markov_rank": 8,
                  "target_layer_ids": LAYERS},
        "data": {"train": str(data), "max_length": 48},
        "objective": {"num_anchors": 4},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0, **optim},
        "engine": {"device": "cpu", "max_batch": 2, **engine},
        "stream": {"wire_dtype": "float32", "timeout_s": 300.0},
        "train": {"out_dir": str(folder / "run"), "global_batch": 2, "micro_batch": 2, "max_steps": 2,
                  "compute_dtype": "float32", "progress": False, "threads": 1, "wandb_mode": "disabled"},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(1800)  # three training runs of <= 500 s each
def test_trainer_sglang_engine_trains_like_the_hf_engine(sgl_python, target_dir, tmp_path):
    from safetensors.torch import load_file

    from training.tiny import tiny_conversations

    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(8)))
    env = cpu_env({"PYTHONPATH": f"{REPO}{os.pathsep}{cpu_env()['PYTHONPATH']}"})
    runs = {}
    for name, engine, optim in (("hf", {"kind": "hf", "placement": "inprocess"}, {}),
                                ("sglang", {"kind": "sglang", "placement": "colocated"}, {}),
                                ("init", {"kind": "hf", "placement": "inprocess"}, {"lr": 0.0})):
        recipe = _recipe(tmp_path / name, target_dir, data, optim, **engine)
        t0 = time.time()
        res = subprocess.run([str(sgl_python), "-m", "training", "--config", str(recipe)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=500)
        log = tmp_path / name / "run" / "logs" / "engine-0.log"
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:] + (log.read_text()[-3000:]
                                                                             if log.exists() else "")
        print(f"\n{name} engine: 2 steps in {time.time() - t0:.0f}s")
        runs[name] = load_file(str(tmp_path / name / "run" / "draft" / "model.safetensors"))
    assert "via an in-process sglang.Engine on cpu" in (tmp_path / "sglang" / "run" / "logs" / "engine-0.log"
                                                        ).read_text()
    diff = lambda a, b: max(float((runs[a][k] - runs[b][k]).abs().max()) for k in runs[a])
    print(f"draft weights after 2 steps: sglang vs hf engine max |Δ| {diff('sglang', 'hf'):.2e}, "
          f"moved from init by {diff('hf', 'init'):.2e}")
    assert diff("hf", "init") > 1e-3, "training did not move the weights: the comparison would prove nothing"
    assert diff("sglang", "hf") < 1e-4


def test_sglang_engine_without_sglang_is_one_clear_error(monkeypatch):
    import importlib.util

    from dspark_sgl.sglang.engine import EngineError, check_sglang_importable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(EngineError, match="engine.kind=sglang needs SGLang 0.5.23 importable by"):
        check_sglang_importable()
