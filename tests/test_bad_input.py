"""Bad input to the `dspark` command: one clear error (exit 2, the value and what is allowed), never a traceback,
never a silent substitution; Ctrl-C stops a command within about a second."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_sgl.cli import app
from training.tiny import build_tiny_target

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    target = build_tiny_target(base / "target", hidden=32, layers=4)
    draft = base / "draft"
    res = runner.invoke(app, ["init-draft", "--target", str(target), "--out", str(draft), "--markov-rank", "8",
                              "--block-size", "4", "--num-aux", "2"])
    assert res.exit_code == 0, res.output
    return target, draft


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # rich wraps and boxes long messages


def gen(target, draft, *extra):
    return runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "one two",
                               "--max-new-tokens", "4", "--dtype", "float32", *map(str, extra)])


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0.8", "--top-p", "0"], "0<x<=1"),
    (["--top-p", "1.5"], "0<x<=1"),
    (["--max-new-tokens", "-5"], "'--max-new-tokens': Input should be greater than or equal to 1"),
    (["--temperature", "-1"], "'--temperature': Input should be greater than or equal to 0"),
    (["--dtype", "fp8"], "dtype must be one of"),
    (["--block-size", "9"], "--block-size must be in [1, 4]"),
    (["--max-new-tokens", "5000"], "exceeds the target's context length 1024"),
])
def test_out_of_range_options_are_one_clear_error(setup, extra, message):
    res = gen(*setup, *extra)
    assert res.exit_code == 2, res.output
    assert message in flat(res.output) and "Traceback" not in res.output


def test_explicit_shorter_block_size_is_taken(setup):
    target, draft = setup
    res = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "one two",
                              "--max-new-tokens", "6", "--dtype", "float32", "--block-size", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["per_position_accept"]) == 2


def test_config_block_size_other_than_the_trained_one_is_refused(setup, tmp_path):
    target, draft = setup
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes())
    cfg = json.loads((draft / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"block_size": 100}))  # one place edited: they disagree
    res = gen(target, bad)
    assert res.exit_code == 2 and "block_size=100 and dspark_config.block_size=4" in flat(res.output)
    for section in ("dflash_config", "dspark_config"):
        cfg[section]["block_size"] = 100
    (bad / "config.json").write_text(json.dumps(cfg | {"block_size": 100}))
    res = gen(target, bad)
    assert res.exit_code == 2 and "block_size=100 but the weights were trained for 4" in flat(res.output)


def test_truncated_weights_are_named(setup, tmp_path):
    target, draft = setup
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((draft / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes()[:1000])
    res = gen(target, bad)
    assert res.exit_code == 2 and "cannot read weights file" in flat(res.output) and "Traceback" not in res.output


def test_ctrl_c_stops_generate_within_a_second(setup):
    target, draft = setup
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dspark_sgl.cli", "generate", "--target", str(target), "--draft", str(draft),
           "--prompt", "one two", "--max-new-tokens", "1000", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    while "generating up to" not in seen:  # printed just before the first step: no sleep as synchronisation
        ch = proc.stdout.read(1)
        assert ch, f"generate ended before generating: {seen}"
        seen += ch
    # 1,000 tokens (the tiny target's context is 1,024) take seconds: the signal lands mid-generation
    assert proc.poll() is None, "generate finished before the signal: the test would prove nothing"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode != 0, seen + out
    assert "tok/s" not in out, "an interrupted run must not print a result as if complete"
    assert took < 2.5, f"SIGINT took {took:.2f} s"  # 1 s grace at most, plus scheduling on a busy box
