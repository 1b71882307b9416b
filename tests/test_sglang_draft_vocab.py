"""Real SGLang 0.5.23 on CPU, fp32: our DSPARK worker serves a reduced-vocabulary draft (K = 4096 of 49,152)
losslessly — greedy output identical to plain decoding, sampled requests complete (proposals mapped through d2t,
q zero outside the draft vocabulary).

The draft is the testkit's bigram draft restricted to K tokens that hold every bigram successor: its own greedy
choices are unchanged, so it is still accepted, while the K-row heads, d2t and the hot lm_head rows all run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, bigram_table, build_bigram_draft  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # a test may start 2 servers (<= 600 s each) before its requests
]

MAX_NEW, GAMMA, K = 24, 7, 4096
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little",
           "List three primary colors: red,", "Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5, 6,"]


def restrict(full_dir: Path, out_dir: Path, keep: set[int]) -> Path:
    """The same draft over K target ids (keep ∪ the lowest others): markov_w2 rows gathered, d2t set."""
    import dataclasses

    import torch

    from dspark_sgl.model.draft import DSparkDraft

    full = DSparkDraft.from_pretrained(full_dir)
    filler = (i for i in range(full.config.vocab_size) if i not in keep)
    ids = sorted(keep | {next(filler) for _ in range(K - len(keep))})
    draft = DSparkDraft(dataclasses.replace(full.config, draft_vocab_size=K))
    state = full.state_dict()
    state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids]
    draft.load_state_dict(state | {"d2t": torch.tensor(ids) - torch.arange(K)})
    draft.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with Server(smollm2_dir) as s:
        plain = [o["output_ids"] for o in s.generate(ids, MAX_NEW)]
    seqs = [p + o for p, o in zip(ids, plain, strict=True)]
    tmp = tmp_path_factory.mktemp("vocab")
    full = build_bigram_draft(smollm2_dir, seqs, tmp / "full", block_size=GAMMA)
    draft = restrict(full, tmp / "k4096", set(bigram_table(seqs).values()))
    return smollm2_dir, ids, plain, draft


def test_reduced_vocab_draft_is_lossless_in_sglang(setup):
    target_dir, ids, plain, draft = setup
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft)]
    # static verify: the accept length must not depend on an SPS table measured live on a busy box
    with Server(target_dir, args, env={"SGLANG_RAGGED_VERIFY_MODE": "static"}) as s:
        outs = s.generate(ids, MAX_NEW)
        sampled = s.generate(ids[:3], MAX_NEW, temperature=0.8, top_p=0.95)
    assert [o["output_ids"] for o in outs] == plain
    mean_accept = sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs)
    assert mean_accept > 1.2, f"the restricted bigram draft should still be accepted: {mean_accept:.2f}"
    for o in sampled:
        assert o["meta_info"]["spec_verify_ct"] > 0 and len(o["output_ids"]) > 0
