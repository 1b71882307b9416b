"""The `dspark` command end to end on a tiny target folder (real tokenizer + chat template, no download)."""

import json

import pytest
from typer.testing import CliRunner

from dspark_sgl.cli import app
from training.tiny import build_tiny_target

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target", hidden=32, layers=4)


def invoke(*args):
    args = [str(a) for a in args]
    if args[0] in ("generate", "eval", "calibrate") and "--dtype" not in args:
        args += ["--dtype", "float32"]  # T=0 identity is exact in fp32 (auto may pick bf16 on this CPU)
    return runner.invoke(app, args)


def test_init_generate_eval_calibrate(tiny_dir, tmp_path):
    draft = tmp_path / "draft"
    res = invoke("init-draft", "--target", tiny_dir, "--out", draft, "--layers", "1", "--markov-rank", "8",
                 "--block-size", "4", "--num-aux", "2")
    assert res.exit_code == 0, res.output
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["mask_token_id"] == 3  # the tokenizer's spare special token <|mask|>, chosen explicitly
    assert cfg["block_size"] == 4 and len(cfg["target_layer_ids"]) == 2

    res = invoke("generate", "--target", tiny_dir, "--draft", draft, "--chat", "one two three", "--max-new-tokens",
                 "12", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) >= {"text", "token_ids", "tau", "tokens_per_s", "per_position_accept"}
    plain = invoke("generate", "--target", tiny_dir, "--no-draft", "--chat", "one two three", "--max-new-tokens",
                   "12", "--json")
    assert json.loads(plain.stdout.strip().splitlines()[-1])["token_ids"] == out["token_ids"]  # lossless at T=0
    assert len(out["per_position_accept"]) == 4

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [q]}) for q in ["a b c", "hello how are you", "one two"]) + "\n")
    report = tmp_path / "report.json"
    res = invoke("eval", "--target", tiny_dir, "--draft", draft, "--data", data, "--max-new-tokens", "10",
                 "--json-out", report)
    assert res.exit_code == 0, res.output
    rep = json.loads(report.read_text())["datasets"][0]
    assert rep["name"] == "prompts" and rep["prompts"] == 3
    # eval's per-request τ is what `generate` reports for each prompt alone (batch 1, fp32, T=0: deterministic)
    alone = []
    for q in ["a b c", "hello how are you", "one two"]:
        res = invoke("generate", "--target", tiny_dir, "--draft", draft, "--chat", q, "--max-new-tokens", "10",
                     "--json")
        alone.append(json.loads(res.stdout.strip().splitlines()[-1])["tau"])
    assert rep["tau_per_request"] == pytest.approx(sum(alone) / 3, abs=1e-9), (rep["tau_per_request"], alone)

    res = invoke("calibrate", "--target", tiny_dir, "--draft", draft, "--data", data, "--max-new-tokens", "10")
    assert res.exit_code == 0, res.output
    sts = json.loads((draft / "sts.json").read_text())
    assert len(sts["temperatures"]) == 4 and all(t > 0 for t in sts["temperatures"])
    # the calibrated draft loads with its temperatures, and the confidence schedule runs from a saved SPS table
    sps = tmp_path / "sps.json"
    res = invoke("profile-sps", "--target", tiny_dir, "--out", sps, "--max-tokens", "8", "--context", "8",
                 "--repeats", "1")
    assert res.exit_code == 0, res.output
    res = invoke("generate", "--target", tiny_dir, "--draft", draft, "--chat", "one two", "--max-new-tokens", "8",
                 "--schedule", "confidence", "--sps-table", sps, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["token_ids"] == json.loads(
        invoke("generate", "--target", tiny_dir, "--no-draft", "--chat", "one two", "--max-new-tokens", "8",
               "--json").stdout.strip().splitlines()[-1])["token_ids"]
    # the recipe's closing eval with eval.schedule=confidence (SPS profiled for its batch): same tokens as plain
    from training.recipe import Recipe
    from training.trainer import final_eval

    recipe = Recipe.model_validate({"target": {"path": str(tiny_dir)}, "eval": {
        "datasets": [str(data)], "num_prompts": 3, "max_new_tokens": 10, "dtype": "float32", "batch_size": 3,
        "schedule": "confidence"}})
    res = final_eval(recipe, draft, tmp_path / "eval.json", log=lambda *_: None)
    assert res["dspark"]["meta"]["schedule"] == "confidence"
    assert res["dspark"]["datasets"][0]["tokens"] == res["plain"]["datasets"][0]["tokens"] == rep["tokens"]


def test_bad_input_gives_one_clear_error(tiny_dir, tmp_path):
    res = invoke("generate", "--target", tmp_path / "nope", "--chat", "x")
    assert res.exit_code == 2 and "neither" in res.output
    res = invoke("generate", "--target", tiny_dir, "--prompt", "x", "--chat", "y")
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = invoke("init-draft", "--target", tiny_dir, "--out", tmp_path / "d", "--layer-ids", "1,9")
    assert res.exit_code == 2 and "only 4 layers" in res.output
    res = invoke("generate", "--target", tiny_dir, "--draft", tmp_path / "missing", "--chat", "x")
    assert res.exit_code == 2 and "no config.json" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no turns"}\n')
    res = invoke("eval", "--target", tiny_dir, "--no-draft", "--data", bad)
    assert res.exit_code == 2 and "bad.jsonl:1" in res.output


def test_eval_writes_a_per_position_acceptance_plot_per_dataset(tiny_dir, tmp_path):
    draft = tmp_path / "draft"
    assert invoke("init-draft", "--target", tiny_dir, "--out", draft, "--layers", "1", "--markov-rank", "8",
                  "--block-size", "3", "--num-aux", "2").exit_code == 0
    sets = []
    for name in ("math", "chat"):
        sets += ["--data", tmp_path / f"{name}.jsonl"]
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"turns": [f"{name} one two"]}) + "\n")
    res = invoke("eval", "--target", tiny_dir, "--draft", draft, *sets, "--max-new-tokens", "6",
                 "--json-out", tmp_path / "out" / "report.json")
    assert res.exit_code == 0, res.output
    for name in ("math", "chat"):  # beside the JSON, one per dataset
        assert (tmp_path / "out" / f"report.{name}.accept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = invoke("eval", "--target", tiny_dir, "--draft", draft, *sets[:2], "--max-new-tokens", "6",
                 "--plot-dir", tmp_path / "plots")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "plots" / "math.accept.png").read_bytes()[:4] == b"\x89PNG"
