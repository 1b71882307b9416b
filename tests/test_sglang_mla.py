"""Real SGLang 0.5.23 on CPU, fp32, with MLA drafts (the k3_dspark folder layout): `--speculative-algorithm DSPARK`
runs our worker, whose own draft pool holds the MLA latent per slot. Two random MLA drafts (testkit
`build_random_draft`, every weight N(0, 0.5), the bigram table of the target's greedy outputs in the Markov head), so
each proposal depends on the MLA attention over the draft context, positions and the previous token:
    K > V  - key heads wider than value heads (qk_nope + qk_rope = 32 > v_head_dim = 16), Kimi-K3's shape (192 > 128)
    K < V  - key heads narrower than value heads (8 + 8 = 16 < v_head_dim = 32)
(The GQA draft has one head_dim for keys and values: MLA is the draft's only K != V attention.)
At T = 0 under the static schedule each served request's output equals plain SGLang's and the reference engine's,
and its per-step accepted-count histogram equals the reference engine's `accept_hist` on the same prompts.

Target: the testkit's tiny random 8-token Llama (as tests/test_sglang_planted.py), where a random draft is accepted
often enough for the histograms to say something. Three servers (plain, K > V, K < V).
Can fail: with DSPARK_SGL_PLANT=context_keep on the DSPARK server only, K < V's served histograms differ
([[3, 5, 2, 1], ...] vs [[8, 8, 0, 0], ...]) while the outputs stay lossless.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import (  # noqa: E402
    Server,
    build_random_draft,
    build_tiny_target,
    reference_accept,
    served_hists,
)

from tests.test_sglang_sampling import PROMPTS  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1800),  # the module starts 3 servers (<= 600 s each)
]
V, GAMMA, MAX_NEW = 8, 3, 24
MLA = {  # name -> the MLA dims of a draft on the tiny target (hidden 64, 4 heads)
    "K>V": dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "K<V": dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=32),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The tiny target, plain SGLang's greedy outputs on it, and its greedy sequences for the drafts' bigram heads."""
    tmp = tmp_path_factory.mktemp("mla")
    target = build_tiny_target(tmp / "target", vocab=V)
    with Server(target) as s:
        plain = [o["output_ids"] for o in s.generate(PROMPTS, MAX_NEW, ignore_eos=True)]
    return {"target": target, "plain": plain, "tmp": tmp,
            "seqs": [p + o for p, o in zip(PROMPTS, plain, strict=True)]}


@pytest.mark.parametrize("shape", list(MLA))
def test_mla_draft_matches_the_reference_engine_step_by_step(setup, shape):
    target = setup["target"]
    draft = build_random_draft(target, setup["tmp"] / shape.replace("<", "lt").replace(">", "gt"), block_size=GAMMA,
                               std=0.5, sequences=setup["seqs"], scale=3.0, target_layer_ids=[0, 1, 2],
                               attention_type="mla", num_key_value_heads=4, **MLA[shape])
    assert '"K3DSparkModel"' in (draft / "config.json").read_text()
    ref = reference_accept(target, draft, PROMPTS, MAX_NEW)
    assert ref["plain"] == setup["plain"], "the reference engine's target must agree with plain SGLang's"
    assert ref["outputs"] == ref["plain"]
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(GAMMA)]
    with Server(target, args, env={"SGLANG_RAGGED_VERIFY_MODE": "static"}) as s:
        out = s.generate(PROMPTS, MAX_NEW, ignore_eos=True)
    assert [o["output_ids"] for o in out] == setup["plain"]
    hists = served_hists(out, GAMMA)
    print(f"MLA {shape}: served {hists} reference {ref['hists']}")
    assert hists == ref["hists"], f"served {hists} != reference {ref['hists']}"
