"""Drift analysis (card 000's method): exact self-check, the format ranking, regimes, outputs, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import typer
from typer.testing import CliRunner

from dspark_sgl.config import DSparkConfig
from dspark_sgl.tools import drift as D
from dspark_sgl.tools.cli_tools import register
from tests.conftest import require, tiny_draft_config

GAMMA = 5


def tiny_config(**kw) -> DSparkConfig:
    return tiny_draft_config(**(dict(num_hidden_layers=3, block_size=GAMMA, markov_rank=32) | kw))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    require("compressed_tensors")
    from dspark_sgl.tools.quantize import quantize_draft

    root = tmp_path_factory.mktemp("drift")
    D.random_draft(tiny_config(), seed=0).save_pretrained(root / "ref")
    for scheme in ("fp8", "nvfp4", "mxfp4"):
        quantize_draft(root / "ref", root / scheme, scheme=scheme)
    return root


def heads(config: DSparkConfig):
    return D.synthetic_heads(config.vocab_size, config.hidden_size, seed=0)


def test_fp32_against_itself_is_exact():
    ref = D.random_draft(tiny_config(), seed=1)
    ref_model, variants = D.load_variants(ref, ["fp32"], floor=False)
    (v,) = variants
    assert v.weight_snr_db == math.inf
    report = D.run_drift(ref_model, variants, D.DriftSettings(blocks=24, regimes=("boot", "gauss")), *heads(ref.config))
    for regime in ("boot", "gauss"):
        s = report.variants[0]["regimes"][regime]
        assert s["ceiling"]["mean"] == GAMMA and s["ceiling"]["lo"] == GAMMA and s["ceiling"]["hi"] == GAMMA
        assert s["ceiling_card"] == GAMMA
        assert s["kl_mean"]["mean"] == 0 and s["kl_p99"] == 0 and s["one_minus_tv"]["mean"] == 1
        assert s["hidden_rel_err"]["mean"] == 0 and s["flip_rate"]["mean"] == 0
        assert s["greedy_agreement"]["mean"] == 1 and s["confidence_r"]["r"] == 1
        assert [p["mean"] for p in s["per_position_sequential"]] == [1.0] * GAMMA


def test_ranking_bf16_fp8_nvfp4_mxfp4(folders):
    ref, variants = D.load_variants(folders / "ref", [str(folders / s) for s in ("fp8", "nvfp4", "mxfp4")])
    assert [v.label for v in variants] == ["BF16", "FP8", "NVFP4", "MXFP4"]
    snr = [v.weight_snr_db for v in variants]
    assert snr[0] == math.inf  # bf16-exact reference weights: the BF16 floor is pure compute noise
    assert snr[1] > snr[2] > snr[3] and 30 < snr[1] < 34 and 19.5 < snr[2] < 21.5 and 18 < snr[3] < 20
    settings = D.DriftSettings(blocks=96, regimes=("boot", "heavy"), batch_seqs=12)
    report = D.run_drift(ref, variants, settings, *heads(ref.config))
    pooled_kl = [0.0] * 4
    for regime in settings.regimes:
        stats = [v["regimes"][regime] for v in report.variants]
        kl = [s["kl_mean"]["mean"] for s in stats]
        assert kl[0] < kl[1] < min(kl[2], kl[3]), (regime, kl)
        pooled_kl = [a + b for a, b in zip(pooled_kl, kl, strict=True)]
        hid = [s["hidden_rel_err"]["mean"] for s in stats]
        assert hid[0] < hid[1] < hid[2] < hid[3], (regime, hid)
        ceiling = [s["ceiling"]["mean"] for s in stats]
        assert ceiling[0] > ceiling[1] > ceiling[3] and ceiling[0] < GAMMA, (regime, ceiling)
        for s in stats:  # every agreement metric comes with a CI that brackets it
            for key in ("ceiling", "greedy_agreement", "sequential_agreement", "one_minus_tv", "flip_rate"):
                assert s[key]["lo"] <= s[key]["mean"] <= s[key]["hi"], key
            assert s["blocks"] == 96 and len(s["per_position_sequential"]) == GAMMA
            assert 0 <= s["ceiling_card"] <= GAMMA
        assert stats[3]["confidence_r"]["r"] < stats[1]["confidence_r"]["r"] <= 1
    # NVFP4 vs MXFP4 is a 1.4 dB weight-SNR gap: on a draft this small one regime's error realisation can swap
    # them (seen on 1 of 6 seed×regime cells), so like the card we rank on the pooled regimes.
    assert pooled_kl[2] < pooled_kl[3], pooled_kl


def test_regimes_differ_as_designed():
    ref = D.random_draft(tiny_config(), seed=2)
    ref.bind_target(*heads(ref.config))
    ids = torch.randint(0, 95, (4, 32), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    kurt = {}
    for regime in ("gauss", "heavy", "boot"):
        aux = D.regime_aux(regime, ref, ids, g)
        assert aux.shape == (4, 32, 2 * 64) and torch.isfinite(aux).all()
        x = aux.flatten().double()
        kurt[regime] = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    assert kurt["heavy"] > 2 * kurt["gauss"]  # Student-t(3) tails
    boot = D.regime_aux("boot", ref, ids, g)
    assert torch.equal(boot, D.regime_aux("boot", ref, ids, g))  # deterministic: the draft's own layers
    assert not torch.equal(boot[0, 0], boot[0, 1])
    with pytest.raises(D.DriftError, match="needs --target"):
        D.regime_aux("target", ref, ids, g)
    with pytest.raises(D.DriftError, match="unknown regime"):
        D.regime_aux("uniform", ref, ids, g)


def test_real_target_aux_and_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark_sgl.targets.hf import HFTarget

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        )
    )
    target = HFTarget(model, [0, 2])
    ref = D.random_draft(tiny_config(), seed=3)
    ref_model, variants = D.load_variants(ref, ["fp32"])
    report = D.run_drift(
        ref_model,
        variants,
        D.DriftSettings(blocks=16, regimes=("target",)),
        target.embed_tokens,
        target.lm_head,
        stream=list(range(90)) * 3,
        target=target,
    )
    assert report.heads == "target"
    fp32 = next(v for v in report.variants if v["label"] == "FP32")["regimes"]["target"]
    assert fp32["ceiling"]["mean"] == GAMMA
    bf16 = next(v for v in report.variants if v["label"] == "BF16")["regimes"]["target"]
    assert 0 < bf16["kl_mean"]["mean"] < 0.05


def test_report_json_tables_and_png(folders, tmp_path):
    ref, variants = D.load_variants(folders / "ref", [str(folders / "nvfp4")])
    report = D.run_drift(ref, variants, D.DriftSettings(blocks=16, regimes=("gauss",)), *heads(ref.config))
    data = json.loads(report.to_json())
    assert data["gamma"] == GAMMA and data["variants"][0]["weight_snr_db"] == "inf"
    assert data["variants"][1]["regimes"]["gauss"]["ceiling"]["n"] == 16
    from rich.console import Console

    console = Console(record=True, width=200)
    for table in D.report_tables(report):
        console.print(table)
    text = console.export_text()
    assert "FP32 reference" in text and "NVFP4" in text and "exact" in text and "Weight SNR" in text
    png = D.plot_decay(report, tmp_path / "decay.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_end_to_end_and_errors(folders, tmp_path):
    app = typer.Typer()
    register(app)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": list(range(i, i + 40))}) for i in range(0, 50, 10)) + "\n")
    out = tmp_path / "report" / "drift"
    res = CliRunner().invoke(
        app,
        [
            "drift",
            "--reference",
            str(folders / "ref"),
            "--candidate",
            "fp32",
            "--candidate",
            str(folders / "mxfp4"),
            "--data",
            str(data),
            "--regimes",
            "gauss",
            "--blocks",
            "16",
            "--seq-len",
            "24",
            "--out",
            str(out),
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.with_suffix(".json").read_text())
    assert [v["label"] for v in report["variants"]] == ["BF16", "FP32", "MXFP4"]
    assert out.with_suffix(".png").exists() and "Drift-limited acceptance ceiling" in res.output
    for args, message in [
        (["--regimes", "uniform"], "unknown regimes"),
        (["--regimes", "target"], "needs --target"),
        (["--candidate", str(tmp_path / "missing")], "neither fp32/bf16/fp16 nor a draft folder"),
    ]:
        base = ["drift", "--reference", str(folders / "ref"), "--blocks", "4", "--out", str(tmp_path / "x")]
        if "--candidate" not in args:
            base += ["--candidate", "fp32"]
        bad = CliRunner().invoke(app, base + args)
        assert bad.exit_code == 2 and message in bad.output, bad.output
