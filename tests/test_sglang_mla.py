"""Real SGLang 0.5.23 on CPU with an MLA draft (the k3_dspark folder layout): `--speculative-algorithm DSPARK` runs
our worker, whose own draft pool holds the MLA latent per slot, and greedy output equals plain decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, build_bigram_draft  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # the test starts 2 servers (<= 600 s each)
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6,"]
MLA = dict(attention_type="mla", num_key_value_heads=9, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
           qk_rope_head_dim=32, v_head_dim=32)


def test_mla_draft_greedy_output_is_identical_to_plain_decoding(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with Server(smollm2_dir) as s:
        plain = [o["output_ids"] for o in s.generate(ids, 24)]
    draft = build_bigram_draft(smollm2_dir, [i + o for i, o in zip(ids, plain, strict=True)], tmp_path / "mla",
                               block_size=4, **MLA)
    assert '"K3DSparkModel"' in (draft / "config.json").read_text()
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", "4"]
    with Server(smollm2_dir, args) as s:
        out = s.generate(ids, 24)
    assert [o["output_ids"] for o in out] == plain
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0  # the DSPARK worker did run
