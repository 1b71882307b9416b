"""Our DSPARK worker against SGLang 0.5.23's own (builtin) DSPARK worker, real servers on CPU, fp32, T = 0.

The builtin is an independent implementation of the same draft and the same greedy rule, so on one draft, one build
and one schedule (static: every request verifies γ + 1 tokens) the two must agree on every output token AND on how
many drafts each verify step accepted (the per-request `spec_correct_drafts_histogram`), and the builtin must be
lossless too. The builtin runs on CPU through the test-only shim dspark_sgl/sglang/cpu/builtin.py (greedy only).

The draft is full-vocabulary (the builtin has no d2t) and its proposals depend on the backbone and the context: a
random fp32 backbone at full output norm (base logits = the target lm_head of its hidden state, max ≈ 10-14 over
the vocabulary) plus a bigram Markov bias (scale 40) fitted to the target's greedy outputs on the FITTED prompts. On
those, drafts are accepted at every depth 0..γ, and the backbone still decides contested picks (in the reference
engine, 5 of the 10 histograms differ from the same table with a silenced backbone); on the HELD_OUT prompts,
which the table never saw, acceptance is low and every proposal whose previous token is not in the table is the
backbone's own. Both sets are compared. Three server starts (plain, builtin, ours), each reused by the module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, build_bigram_draft  # noqa: E402

from dspark_sgl.sglang.cpu.builtin import HARNESS_ENV  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),
]

MAX_NEW = 32
GAMMA = 5
STATIC = {"SGLANG_RAGGED_VERIFY_MODE": "static"}
FITTED = [  # the bigram table is fitted to the target's outputs on these
    "The capital of France is",
    "def fibonacci(n):",
    "List three primary colors: red,",
    "Monday, Tuesday, Wednesday,",
    "SELECT name, age FROM users WHERE",
    "10, 20, 30, 40,",
]
HELD_OUT = [
    "Q: What is 12 plus 7?\nA:",
    "import numpy as np\n\ndef mean(xs):",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok(p)["input_ids"] for p in FITTED + HELD_OUT]


@pytest.fixture(scope="module")
def plain(smollm2_dir, prompt_ids) -> list[list[int]]:
    with Server(smollm2_dir) as s:
        return [o["output_ids"] for o in s.generate(prompt_ids, MAX_NEW)]


@pytest.fixture(scope="module")
def draft(smollm2_dir, prompt_ids, plain, tmp_path_factory) -> Path:
    seqs = [p + o for p, o in zip(prompt_ids, plain, strict=True)][: len(FITTED)]
    return build_bigram_draft(smollm2_dir, seqs, tmp_path_factory.mktemp("draft") / "random", block_size=GAMMA,
                              scale=40.0, final_norm=1.0, seed=1)


def serve(smollm2_dir, draft, env, prompts) -> dict[str, list]:
    """All prompts at once, then one fitted and one held-out prompt alone: outputs and accept histograms of each."""
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(GAMMA)]
    with Server(smollm2_dir, args, env={**STATIC, **env}) as s:
        outs = s.generate(prompts, MAX_NEW) + [s.generate([prompts[i]], MAX_NEW)[0] for i in (0, -1)]
    return {"tokens": [o["output_ids"] for o in outs],
            "hist": [o["meta_info"]["spec_correct_drafts_histogram"] for o in outs]}


@pytest.fixture(scope="module")
def builtin(smollm2_dir, draft, prompt_ids) -> dict[str, list]:
    return serve(smollm2_dir, draft, HARNESS_ENV, prompt_ids)


@pytest.fixture(scope="module")
def ours(smollm2_dir, draft, prompt_ids) -> dict[str, list]:
    return serve(smollm2_dir, draft, {}, prompt_ids)


def test_builtin_on_cpu_is_lossless(builtin, plain):
    assert builtin["tokens"] == plain + [plain[0], plain[-1]]


def test_ours_equals_the_builtin_token_for_token_and_step_for_step(ours, builtin):
    assert ours["tokens"] == builtin["tokens"]
    assert ours["hist"] == builtin["hist"]  # per request: how many verify steps accepted 0, 1, ..., γ drafts
    # the comparison has teeth: steps accept every number of drafts from 0 to γ
    depths = {k for hist in builtin["hist"] for k, n in enumerate(hist) if n}
    assert depths == set(range(GAMMA + 1)), builtin["hist"]
