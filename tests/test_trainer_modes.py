"""Engine placements and front ends: colocated streaming equals in-process capture, the sglang engine says what it
needs, the Kimi-K3 recipe dry-runs on the meta device with the model card's parameter count, `dspark train` parses."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tests.test_trainer import ROOT, assert_same_weights, run_training, tiny, weights, write_recipe  # noqa: F401


@pytest.mark.slow
@pytest.mark.timeout(900)  # two training runs of <= 300 s each
def test_colocated_stream_equals_inprocess(tiny, tmp_path):  # noqa: F811
    inproc = write_recipe(tiny, tmp_path / "inproc", train={"max_steps": 3})
    coloc = write_recipe(tiny, tmp_path / "coloc", train={"max_steps": 3},
                         engine={"placement": "colocated", "max_batch": 1}, stream={"wire_dtype": "float32"})
    run_training(inproc)
    run_training(coloc)
    # The engine pads its own batches, so features can differ in the last bits from the in-process capture.
    assert_same_weights(weights(tmp_path / "inproc" / "run"), weights(tmp_path / "coloc" / "run"), atol=1e-5)
    assert (tmp_path / "coloc" / "run" / "logs" / "engine-0.log").exists()


def test_kimi_recipe_dry_run_matches_the_model_card():
    out = subprocess.run([sys.executable, "-m", "training", "--config", "configs/kimi-k3-dspark.yaml", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={"COLUMNS": "200",
                                                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2,249,289,601" in out.stdout  # RadixArk/Kimi-K3-DSpark: "2,249,289,601 parameters"
    assert "16 ranks × 32 accumulation × 1 micro" in out.stdout
    assert "total" in out.stdout


def test_kimi_recipe_rejects_a_wrong_world_size():
    out = subprocess.run([sys.executable, "-m", "training", "--config", "configs/kimi-k3-dspark.yaml", "--dry-run",
                          "--world-size", "24"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "must be divisible by world size 24" in out.stderr


def test_dspark_train_command_parses_overrides(tmp_path):
    from training.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a typer app with one command would swallow the command name
    bad = CliRunner().invoke(app, ["train", "--config", str(ROOT / "configs/kimi-k3-dspark.yaml"), "optim.lrr=1"])
    assert bad.exit_code == 2 and "unknown key(s) ['lrr'] in optim" in bad.output


def _engine_pids(marker: str) -> list[int]:
    from pathlib import Path

    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "training.engine_server" in cmd and marker in cmd:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 2 runs of <= 300 s, a <= 240 s wait for the kill
def test_engine_sigkilled_mid_run_is_restarted_and_changes_nothing(tiny, tmp_path):  # noqa: F811
    """Colocated engine SIGKILLed after step 2: the trainer waits, restarts it, re-sends what was in flight, and
    ends with the weights of an undisturbed run (no sample lost or trained twice)."""
    import json
    import os
    import signal
    import time

    sections = dict(train={"max_steps": 6}, engine={"placement": "colocated", "max_batch": 1},
                    stream={"wire_dtype": "float32", "timeout_s": 2.0})
    calm = write_recipe(tiny, tmp_path / "calm", **sections)
    run_training(calm)
    hit = write_recipe(tiny, tmp_path / "hit", **sections)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "training", "--config", str(hit)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "hit" / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "run ended before the engine could be killed"
        time.sleep(0.05)
    victims = _engine_pids(str(tmp_path / "hit"))
    assert victims, "no colocated engine process found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting it" in out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 7))
    assert_same_weights(weights(tmp_path / "calm" / "run"), weights(tmp_path / "hit" / "run"), atol=1e-6)


def test_export_on_demand_equals_the_final_export(tiny, tmp_path):  # noqa: F811
    rec = write_recipe(tiny, tmp_path, train={"max_steps": 2, "save_every": 1})
    run_training(rec)
    run_training(rec, "--export")
    from safetensors.torch import load_file

    on_demand = load_file(str(tmp_path / "run" / "draft-step-2" / "model.safetensors"))
    assert_same_weights(weights(tmp_path / "run"), on_demand, atol=0)
    png = (tmp_path / "run" / "curves.png").read_bytes()  # loss and τ curves beside metrics.jsonl
    assert png.startswith(b"\x89PNG") and len(png) > 5000
