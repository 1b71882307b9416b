"""The trainer end to end on a tiny random Llama target (CPU, fp32, gloo).

- the per-layer-sharded forward is DSparkDraft.forward_train, exactly;
- a 2-rank FSDP run equals a 1-rank run with the same global batch;
- a run SIGKILLed mid-way and resumed ends with the weights of an uninterrupted run;
- bad input (recipe keys, layer ids, hidden size, empty data, NaN hidden states) fails with one clear error and
  leaves the last checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dspark_sgl.config import ConfigError
from training.checkpoint import latest_checkpoint
from training.data import DataError
from training.recipe import RecipeError, load_recipe
from training.target import EngineError, draft_config, target_config
from training.tiny import build_tiny_target, mask_token_id, tiny_conversations

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tiny")
    target = build_tiny_target(base / "target")
    data = base / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(24)))
    return {"target": str(target), "data": str(data), "mask": mask_token_id(target)}


def write_recipe(tiny: dict, folder: Path, **sections) -> Path:
    recipe = {
        "target": {"path": tiny["target"], "dtype": "float32"},
        "draft": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
                  "block_size": 4, "mask_token_id": tiny["mask"], "markov_rank": 8, "target_layer_ids": [0, 2]},
        "data": {"train": tiny["data"], "max_length": 48},
        "objective": {"num_anchors": 6},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.2},
        "train": {"out_dir": str(folder / "run"), "global_batch": 4, "micro_batch": 1, "max_steps": 4,
                  "compute_dtype": "float32", "progress": False, "threads": 1},
    }
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    path = folder / "recipe.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_training(recipe: Path, *args: str, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "training", "--config", str(recipe), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), "-m", "training", "--config", str(recipe), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "draft" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"max weight difference {worst:.3g} > {atol}"


# ---- equality across world sizes and across a kill ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)  # three training runs of <= 300 s each
def test_two_ranks_equal_one_rank(tiny, tmp_path):
    one = write_recipe(tiny, tmp_path / "one")
    two = write_recipe(tiny, tmp_path / "two", train={"micro_batch": 2})  # 2 ranks × 2 = global 4, no accumulation
    run_training(one)
    run_training(two, nproc=2)
    w1, w2 = weights(tmp_path / "one" / "run"), weights(tmp_path / "two" / "run")
    init = weights_after_zero_steps(tiny, tmp_path)
    assert max(float((w1[k] - init[k]).abs().max()) for k in w1) > 1e-3, "training did not move the weights"
    assert_same_weights(w1, w2, atol=2e-5)


def weights_after_zero_steps(tiny, tmp_path) -> dict:
    rec = write_recipe(tiny, tmp_path / "zero", optim={"lr": 0.0})
    run_training(rec)
    return weights(tmp_path / "zero" / "run")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 2 runs of <= 300 s and a <= 240 s wait for the kill
def test_kill_and_resume_equals_uninterrupted(tiny, tmp_path):
    steps = {"max_steps": 8, "save_every": 1}
    full = write_recipe(tiny, tmp_path / "full", train=steps)
    run_training(full)
    killed = write_recipe(tiny, tmp_path / "killed", train=steps)
    ckpts = tmp_path / "killed" / "run" / "checkpoints"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "training", "--config", str(killed)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while latest_checkpoint(ckpts) is None or latest_checkpoint(ckpts).name < "step-00000003":
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = latest_checkpoint(ckpts).name
    assert killed_at < "step-00000008", "the run finished before the kill"
    run_training(killed, "--resume")
    assert_same_weights(weights(tmp_path / "full" / "run"), weights(tmp_path / "killed" / "run"), atol=0)


def test_small_budget_options_resume_exactly_and_export_the_trained_function(tiny, tmp_path):
    """Warm start + fc input scale + RAM feature cache + per-module LR groups, end to end: the measured scale rides in
    the checkpoint (a resumed run does not re-measure it on other data), and the export folds it into fc."""
    opts = {"optim": {"lr": 3e-3, "warmup_ratio": 0.2, "scale_aux": True, "lr_scale": {"markov_head": 0.5}},
            "init": {"target_layers": [2, 3]},
            "draft": {"intermediate_size": 64},  # the tiny target's FFN, so its layers can be copied
            "stream": {"memory_cache_mb": 64}, "train": {"max_steps": 8, "save_every": 4}}
    full = write_recipe(tiny, tmp_path / "full", **opts)
    out = run_training(full)
    assert "draft layers copied from target layers [2, 3]" in out.stdout
    # "Kill" after step 4: drop the step-8 checkpoint and the export, point `latest` back at step 4, resume.
    again = write_recipe(tiny, tmp_path / "again", **opts)
    run_training(again)
    ckpts = tmp_path / "again" / "run" / "checkpoints"
    import shutil

    shutil.rmtree(ckpts / "step-00000008")
    shutil.rmtree(tmp_path / "again" / "run" / "draft")
    (ckpts / "latest").write_text("step-00000004\n")
    out = run_training(again, "--resume")
    assert "resumed from step 4" in out.stdout
    a, b = weights(tmp_path / "full" / "run"), weights(tmp_path / "again" / "run")
    assert_same_weights(a, b, atol=1e-5)  # cached vs re-captured features: same fp32 target, same values
    init = weights_after_zero_steps(tiny, tmp_path)
    assert float((a["fc.weight"] - init["fc.weight"]).abs().max()) > 1e-3


def test_time_budget_stops_the_run_with_the_cosine_at_its_end(tiny, tmp_path):
    """train.minutes: a run whose step cap is far away stops once its budget is spent, checkpoints that step with
    the time spent, and its LR has followed the cosine down to (nearly) its floor; resuming it trains no further."""
    recipe = write_recipe(tiny, tmp_path, train={"max_steps": 100_000, "minutes": 0.25, "log_every": 1})
    out = run_training(recipe)
    found = re.search(r"train.minutes=0.25 spent after step (\d+) of at most 100000", out.stdout)
    assert found, out.stdout[-2000:]
    step = int(found.group(1))
    meta = torch.load(latest_checkpoint(tmp_path / "run" / "checkpoints") / "meta.pt", weights_only=False)
    budget = meta["stream"]["budget"]
    assert meta["step"] == step and 15.0 <= budget["train_s"] < 90.0 and 0 < budget["train_from_s"] < 15.0
    assert meta["sched"]["_last_lr"][0] < 0.05 * 3e-3, "the LR did not follow the budget's cosine"
    again = run_training(recipe, "--resume")
    assert f"resumed from step {step}" in again.stdout and "spent after step" not in again.stdout
    meta2 = torch.load(latest_checkpoint(tmp_path / "run" / "checkpoints") / "meta.pt", weights_only=False)
    assert meta2["step"] == step


# ---- bad input ---------------------------------------------------------------------------------------------
def test_unknown_recipe_key_is_named(tiny, tmp_path):
    path = write_recipe(tiny, tmp_path, train={"learning_rate": 1e-3})
    with pytest.raises(RecipeError, match=r"unknown key\(s\) \['learning_rate'\] in train"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="unknown key"):
        load_recipe(write_recipe(tiny, tmp_path), ["optim.lrr=1"])


def test_override_types_are_checked(tiny, tmp_path):
    path = write_recipe(tiny, tmp_path)
    assert load_recipe(path, ["train.max_steps=7"]).train.max_steps == 7
    with pytest.raises(RecipeError, match="train.global_batch"):
        load_recipe(path, ["train.global_batch=abc"])
    assert load_recipe(path, ["optim.lr=3e-3"]).optim.lr == 3e-3  # PyYAML reads 3e-3 as a string
    with pytest.raises(RecipeError, match="optim.lr"):
        load_recipe(path, ["optim.lr=fast"])


def test_layer_ids_beyond_target(tiny, tmp_path):
    recipe = load_recipe(write_recipe(tiny, tmp_path), ["draft.target_layer_ids=[0,9]"])
    with pytest.raises(ConfigError, match="has only 4 layers"):
        draft_config(recipe, target_config(recipe))


def test_hidden_size_mismatch(tiny, tmp_path):
    recipe = load_recipe(write_recipe(tiny, tmp_path), ["draft.hidden_size=48"])
    with pytest.raises(ConfigError, match="hidden_size=48 != target hidden size 32"):
        draft_config(recipe, target_config(recipe))


def test_empty_dataset(tiny, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    path = write_recipe(tiny, tmp_path, data={"train": str(empty)})
    out = subprocess.run([sys.executable, "-m", "training", "--config", str(path)], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode != 0
    assert "DataError: dataset file" in out.stderr and "is empty" in out.stderr


def test_nan_hidden_states_stop_before_any_update(tiny, tmp_path, monkeypatch):
    """NaN from the engine at step 3: clear error, the step-2 checkpoint stays the latest and loads."""
    from dspark_sgl.targets.hf import HFTarget
    from training.trainer import train

    calls = {"n": 0}
    real = HFTarget.capture

    def flaky(self, ids, mask=None):
        out = real(self, ids, mask)
        calls["n"] += 1
        if calls["n"] > 8:  # steps 1-2 use 4 micro-batches each
            out.aux[0, 0, 0] = float("nan")
        return out

    monkeypatch.setattr(HFTarget, "capture", flaky)
    path = write_recipe(tiny, tmp_path, train={"save_every": 1, "max_steps": 4})
    recipe = load_recipe(path)
    with pytest.raises(EngineError, match="non-finite hidden states"):
        train(recipe, str(path))
    ckpts = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step-00000002"
    assert not list(ckpts.glob("*.tmp"))
    meta = torch.load(latest_checkpoint(ckpts) / "meta.pt", weights_only=False)
    assert meta["step"] == 2


def test_data_error_type_is_value_error():
    assert issubclass(DataError, ValueError) and issubclass(RecipeError, ValueError)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 2 runs of <= 300 s, <= 240 + 120 s around the kill
def test_two_rank_run_with_one_rank_killed_resumes_exactly(tiny, tmp_path):
    """SIGKILL one of two ranks mid-run; torchrun tears the job down; `--resume` on 2 ranks ends where an
    uninterrupted 1-rank run ends (sharded DCP checkpoint, per-rank RNG, stream position)."""
    steps = {"max_steps": 6, "save_every": 1, "micro_batch": 2}
    ref = write_recipe(tiny, tmp_path / "ref", train={"max_steps": 6})
    run_training(ref)
    rec = write_recipe(tiny, tmp_path / "two", train=steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "training", "--config", str(rec)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "two" / "run" / "checkpoints"
    deadline = time.time() + 240
    while latest_checkpoint(ckpts) is None or latest_checkpoint(ckpts).name < "step-00000002":
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.05)
    ranks = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _is_rank_of(p, str(rec))]
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)
    proc.wait(timeout=120)
    assert latest_checkpoint(ckpts).name < "step-00000006", "the run finished before the kill"
    run_training(rec, "--resume", nproc=2)
    assert_same_weights(weights(tmp_path / "ref" / "run"), weights(tmp_path / "two" / "run"), atol=2e-5)


def _is_rank_of(proc: Path, recipe: str) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return "-m training --config " + recipe in cmd and "torch.distributed.run" not in cmd
