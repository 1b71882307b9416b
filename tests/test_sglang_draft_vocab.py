"""Real SGLang 0.5.23 on CPU, fp32: our DSPARK worker serves a reduced-vocabulary draft (K = 4096 of 49,152)
losslessly and step for step as the reference engine: at T = 0 under the static schedule, each request's output equals
plain SGLang's and its per-step accepted-count histogram equals the reference engine's `accept_hist` (proposals mapped
through d2t, the K-row heads and the hot lm_head rows all run); sampled requests complete (q zero outside the draft
vocabulary).

The draft is the testkit's random fp32 draft (`build_random_draft`, every weight N(0, 0.5)) over K target ids that
hold every successor of the bigram table of plain SGLang's greedy outputs, which its Markov head carries at a scale
comparable to SmolLM2's random base logits: each proposal is the bigram successor or the backbone's pick over the
draft context. Can fail: a greedy d2t off by one on the DSPARK server only (a local edit of markov.rollout) gives
served histograms [[17, 3, 0, ...], [23, 0, ...], ...] vs [[10, 5, 0, 1, ...], ...]. DSPARK_SGL_PLANT=context_keep
does NOT change them on this draft (its proposals barely read the draft context): tests/test_sglang_mla.py and
tests/test_sglang_planted.py catch that one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import (  # noqa: E402
    Server,
    bigram_table,
    build_random_draft,
    hot_vocab,
    reference_accept,
    served_hists,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # a test may start 2 servers (<= 600 s each) before its requests
]

MAX_NEW, GAMMA, K = 24, 7, 4096
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "List three primary colors: red,", "Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6,"]


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with Server(smollm2_dir) as s:
        plain = [o["output_ids"] for o in s.generate(ids, MAX_NEW, ignore_eos=True)]
    seqs = [p + o for p, o in zip(ids, plain, strict=True)]
    vocab = hot_vocab(set(bigram_table(seqs).values()), len(tok), K)
    draft = build_random_draft(smollm2_dir, tmp_path_factory.mktemp("vocab") / "k4096", block_size=GAMMA, std=0.5,
                               draft_vocab=vocab, sequences=seqs, scale=12.0)
    return smollm2_dir, ids, plain, draft


def test_reduced_vocab_draft_matches_the_reference_engine_in_sglang(setup):
    target_dir, ids, plain, draft = setup
    ref = reference_accept(target_dir, draft, ids, MAX_NEW)
    assert ref["plain"] == plain, "the reference engine's target must agree with plain SGLang's"
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft)]
    # static verify: the accept counts must not depend on an SPS table measured live on a busy box
    with Server(target_dir, args, env={"SGLANG_RAGGED_VERIFY_MODE": "static"}) as s:
        outs = s.generate(ids, MAX_NEW, ignore_eos=True)
        sampled = s.generate(ids[:3], MAX_NEW, temperature=0.8, top_p=0.95)
    assert [o["output_ids"] for o in outs] == plain
    hists = served_hists(outs, GAMMA)
    print(f"reduced vocabulary: served {hists} reference {ref['hists']}")
    assert hists == ref["hists"], f"served {hists} != reference {ref['hists']}"
    for o in sampled:
        assert o["meta_info"]["spec_verify_ct"] > 0 and len(o["output_ids"]) > 0
