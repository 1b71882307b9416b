"""benchmarks/trainer_vs_specforge.py: what it hands SpecForge is what SpecForge's own capture would, and the run's
plumbing (ours + SpecForge + export + `dspark eval`) works end to end on a tiny target.

The fast tests check the offline `.ckpt` features against SpecForge 0.2.0's own normaliser and against the two
conventions it relies on (aux layer i = output of target layer i; the LM head applied with no norm to
`target_last_hidden_states` gives the target's logits), the run config against SpecForge's schema, and the checkpoint
choice by wall time. The slow test runs the script for a fraction of a minute per trainer (no timing asserted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_specforge_compat import _import_specforge  # skips (or fails under REQUIRE) without SpecForge 0.2.0

_import_specforge()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trainer_vs_specforge as tvs  # noqa: E402

from training.data import Sample  # noqa: E402
from training.tiny import build_tiny_target, mask_token_id, tiny_conversations  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("tvs")
    target = build_tiny_target(base / "target")
    conv = base / "conv.jsonl"
    conv.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(24)))
    (base / "eval").mkdir()
    for name in tvs.SETS:
        (base / "eval" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"turns": [c["conversations"][0]["value"]]}) + "\n" for c in tiny_conversations(2, 9)))
    recipe = {
        "target": {"path": str(target), "dtype": "float32"},
        "draft": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
                  "block_size": 4, "mask_token_id": mask_token_id(target), "markov_rank": 8,
                  "target_layer_ids": [0, 2]},
        "data": {"train": str(conv), "max_length": 48},
        "objective": {"num_anchors": 6},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.2},
        "train": {"out_dir": str(base / "run"), "global_batch": 4, "micro_batch": 2, "save_every": 2,
                  "compute_dtype": "float32", "progress": False, "threads": 1},
    }
    (base / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return {"base": base, "target": target, "recipe": base / "recipe.yaml"}


def test_features_are_what_specforge_reads(tiny, tmp_path):
    from specforge.algorithms.common.dflash_family_data import normalize_dspark_offline_sample
    from transformers import AutoModelForCausalLM

    from dspark_sgl.targets.hf import HFTarget

    layers = [0, 2]
    target = HFTarget.from_pretrained(tiny["target"], layers)
    samples = [Sample(7, list(range(5, 17)), [False] * 4 + [True] * 8), Sample(8, list(range(9, 18)), [True] * 9)]
    assert tvs.capture(target, samples, tmp_path, deadline=float("inf"), dtype=torch.float32, batch=2) == 2

    hf = AutoModelForCausalLM.from_pretrained(str(tiny["target"])).eval()
    for s in samples:
        raw = torch.load(tmp_path / f"data_{s.id}.ckpt")
        got = normalize_dspark_offline_sample(raw, max_len=64)  # SpecForge's own reader: keys, shapes, mask rule
        assert got["input_ids"].tolist() == [s.input_ids]
        with torch.no_grad():
            ref = hf(torch.tensor([s.input_ids]), output_hidden_states=True)
        aux = torch.cat([ref.hidden_states[i + 1][0] for i in layers], dim=-1)  # output of layer i (SGLang: i + 1)
        torch.testing.assert_close(got["hidden_states"][0], aux, rtol=1e-4, atol=1e-4)
        # SpecForge's teacher is lm_head(target_last_hidden_states) with no norm: it must give the target's logits
        torch.testing.assert_close(hf.lm_head(got["target_last_hidden_states"][0]), ref.logits[0], rtol=1e-4,
                                   atol=1e-4)


def test_capture_stops_at_the_deadline(tiny, tmp_path):
    from dspark_sgl.targets.hf import HFTarget

    target = HFTarget.from_pretrained(tiny["target"], [0])
    samples = [Sample(i, [5, 6, 7, 8], [True] * 4) for i in range(4)]
    assert tvs.capture(target, samples, tmp_path, deadline=0.0, dtype=torch.float32) == 0
    assert not list(tmp_path.glob("*.ckpt"))


def test_run_config_validates_in_specforge(tiny, tmp_path):
    from specforge.config.schema import load_config

    recipe, dcfg, target_dir = tvs.load(tiny["recipe"], [])
    path = tvs.specforge_config(recipe, dcfg, target_dir, tmp_path, max_steps=10, nproc=2, dtype="bfloat16",
                                warmup_steps=2)
    cfg = load_config(str(path))
    t = cfg.training
    assert t.strategy == "dspark" and t.fsdp_sharding == "NO_SHARD" and t.attention_backend == "sdpa"
    assert t.warmup_ratio == 0.2  # 2 of 10 steps: the warmup ours would use, in steps
    assert t.batch_size * t.accumulation_steps * 2 == recipe.train.global_batch
    assert (t.learning_rate, t.num_anchors, t.loss_decay_gamma) == (recipe.optim.lr, recipe.objective.num_anchors,
                                                                  recipe.objective.gamma_decay)
    assert json.loads((tmp_path / "draft_config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]


def test_pick_nearest_checkpoints_and_the_last():
    ckpts = {20: 100.0, 40: 190.0, 60: 290.0, 80: 400.0, 100: 580.0}
    assert tvs.pick(ckpts, minutes=10, points=3) == [40, 80, 100]  # nearest to 200 s and 400 s, + the last
    assert tvs.pick(ckpts, minutes=10, points=1) == [100]
    assert tvs.pick({}, minutes=10, points=3) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_end_to_end_on_a_tiny_target(tiny, tmp_path):
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trainer_vs_specforge.py"), "--minutes", "0.75",
           "--json-out", str(out), "--recipe", str(tiny["recipe"]), "--data-cache", str(tmp_path / "data"),
           "--root", str(tmp_path / "runs"), "--eval-dir", str(tiny["base"] / "eval"), "--prompts", "1",
           "--max-new-tokens", "8", "--points", "1", "--nproc", "1", "--specforge-step-s", "0.2",
           "--ours-startup-s", "5", "--plot", str(tmp_path / "tau.png")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=850,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["trainer"] for r in rows} == {"ours", "specforge"}
    for r in rows:
        assert r["steps"] > 0 and set(r["tau"]) == set(tvs.SETS) and all(t >= 1.0 for t in r["tau"].values())
        assert (Path(r["draft"]) / "model.safetensors").exists()
    assert (tmp_path / "tau.png").exists()
