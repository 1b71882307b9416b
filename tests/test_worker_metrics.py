"""Real SGLang 0.5.23 (CPU, fp32): our DSPARK worker fills SGLang's own speculative metrics the way the builtin does,
from the `cap_lens` / `block_accept_lens` of its step result. SGLang sums them per request (meta_info
`spec_cap_length`, `spec_block_accept_length`, `spec_cap_lens_histogram`) and per batch into the same counters its
Prometheus gauges `sglang:spec_cap_length` / `sglang:spec_block_accept_length` read (batch_result_processor.py,
metrics_reporter.py; block accept under `cap-accept` only). The gauges themselves need --enable-metrics, i.e.
prometheus_client, which the CPU SGLang venv lacks: meta_info is checked here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, build_bigram_draft  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.timeout(1500)]  # the sglang marker: test-sglang runs it

GAMMA, MAX_NEW = 7, 24
PROMPTS = ["1, 2, 3, 4, 5, 6,", "Monday, Tuesday, Wednesday,", "The capital of France is", "def fibonacci(n):"]


def test_cap_and_block_accept_lengths_reach_sglang_metrics(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    draft = build_bigram_draft(smollm2_dir, ids, tmp_path / "draft", block_size=GAMMA)
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(GAMMA)]
    with Server(smollm2_dir, args, env={"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}) as s:
        outs = s.generate(ids, MAX_NEW)
    for o in outs:
        meta = o["meta_info"]
        steps, hist = meta["spec_verify_ct"], meta["spec_cap_lens_histogram"]
        assert steps > 0 and sum(hist) == steps and len(hist) <= GAMMA + 2 and hist[0] == 0  # lengths in 1..γ+1
        assert meta["spec_cap_length"] == pytest.approx(sum(n * k for n, k in enumerate(hist)) / steps)
        # each step commits c + 1 <= its verify length; the output is the prefill's token plus at most those
        committed = meta["spec_block_accept_length"] * steps
        assert len(o["output_ids"]) <= 1 + committed + 1e-6
        assert meta["spec_block_accept_length"] <= meta["spec_cap_length"] + 1e-9
        assert meta["spec_block_accept_length"] >= 1.0
