"""Real SGLang 0.5.23 (CPU, fp32): our DSPARK worker fills SGLang's own speculative metrics the way the builtin does,
from the `cap_lens` / `block_accept_lens` of its step result: per request `spec_cap_length`,
`spec_block_accept_length` and `spec_cap_lens_histogram` in meta_info, and the Prometheus gauges
`sglang:spec_cap_length` / `sglang:spec_block_accept_length` (SGLang reports block accept under `cap-accept` only).
"""

from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, build_bigram_draft, sglang_python  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sglang_python() is None, reason="needs the sglang venv (point DSPARK_SGL_VENV at it)"),
]

GAMMA, MAX_NEW = 7, 24
PROMPTS = ["1, 2, 3, 4, 5, 6,", "Monday, Tuesday, Wednesday,", "The capital of France is", "def fibonacci(n):"]


def test_cap_and_block_accept_lengths_reach_sglang_metrics(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    draft = build_bigram_draft(smollm2_dir, ids, tmp_path / "draft", block_size=GAMMA)
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(GAMMA), "--enable-metrics", "--decode-log-interval", "1"]
    with Server(smollm2_dir, args, env={"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}) as s:
        outs = s.generate(ids, MAX_NEW)
        with urllib.request.urlopen(s.url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
    for o in outs:
        meta = o["meta_info"]
        steps, hist = meta["spec_verify_ct"], meta["spec_cap_lens_histogram"]
        assert steps > 0 and sum(hist) == steps and len(hist) <= GAMMA + 2 and hist[0] == 0  # lengths in 1..γ+1
        assert meta["spec_cap_length"] == pytest.approx(sum(n * k for n, k in enumerate(hist)) / steps)
        # each step commits c + 1 <= its verify length; SGLang keeps at most what the request asked for
        assert meta["spec_accept_length"] <= meta["spec_block_accept_length"] + 1e-9
        assert meta["spec_block_accept_length"] <= meta["spec_cap_length"] + 1e-9
    gauges = {name: float(v) for name, v in re.findall(r"^sglang:(spec_cap_length|spec_block_accept_length)\{[^}]*\} "
                                                       r"([0-9.e+-]+)$", metrics, re.M)}
    assert set(gauges) == {"spec_cap_length", "spec_block_accept_length"}
    assert 1.0 <= gauges["spec_cap_length"] <= GAMMA + 1
    assert 1.0 <= gauges["spec_block_accept_length"] <= gauges["spec_cap_length"]
