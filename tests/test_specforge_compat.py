"""Checkpoint compatibility with SpecForge 0.2.0's DSpark draft (`DSparkDraftModel`).

A folder written by `DSparkDraft.save_pretrained` must build SpecForge's draft class from its config.json,
load its model.safetensors with strict keys, and give the same logits (fp32, <= 1e-4) for the same inputs:
base logits, Markov-corrected logits and confidence logits, on the training path (many anchor blocks, dense
block mask built by SpecForge itself) and on the inference path (one block against the committed context).

SpecForge is test-only and pins torch/transformers/sglang versions we do not use, so it is installed
without its dependencies: `pip install --no-deps specforge==0.2.0` (its draft modules need only torch,
transformers and safetensors, all of which are ours already); `make install` does. Without it these tests skip, and
fail under DSPARK_REQUIRE_INSTALLED=1 (the CI stages: tests/conftest.py).
"""

from __future__ import annotations

import importlib.metadata
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.speculative.markov import rollout
from tests.conftest import missing, randomize

SPECFORGE_VERSION = "0.2.0"
ATOL = 1e-4
VOCAB, HIDDEN = 97, 64


def _import_specforge():
    try:
        version = importlib.metadata.version("specforge")
    except importlib.metadata.PackageNotFoundError:
        missing("specforge")
    if version != SPECFORGE_VERSION:
        missing("specforge", f"=={SPECFORGE_VERSION} (found {version})")
    with warnings.catch_warnings():  # its eagle module warns that flash_attn is absent
        warnings.simplefilter("ignore")
        from specforge.algorithms.common import dflash_family_model
        from specforge.modeling import auto
    return auto, dflash_family_model


sf_auto, sf_family = _import_specforge()


def make_config(**overrides) -> DSparkConfig:
    kw = dict(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, rope_theta=1000.0, rms_norm_eps=1e-6, block_size=5,
        target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=VOCAB - 1, markov_rank=8,
        markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
    )
    kw.update(overrides)
    return DSparkConfig(**kw)


def target_heads(seed: int) -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    embed, lm_head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(lm_head.weight, std=1 / math.sqrt(HIDDEN))
    return embed, lm_head


def save_ours(config: DSparkConfig, folder, seed: int = 0) -> DSparkDraft:
    ours = DSparkDraft(config).eval()
    randomize(ours, seed)
    ours.save_pretrained(folder)
    return ours


def load_specforge(folder, attn: str = "sdpa") -> nn.Module:
    """SpecForge's own path (export/checkpoint_io.py materialize_draft): config -> registry class; strict."""
    config = sf_auto.AutoDraftModelConfig.from_file(str(folder / "config.json"))
    config._attn_implementation = attn
    model = sf_auto.AutoDraftModel.from_config(config).float().eval()
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model


def markov_logits(ours: DSparkDraft, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    base = ours.base_logits(h)
    return base + ours.markov_head.bias(ours.markov_head.teacher_forced_latent(prev, h)).float()


def confidence_logits(ours: DSparkDraft, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    prev_emb = ours.markov_head.markov_w1(prev) if ours.config.confidence_head_with_markov else None
    return ours.confidence_head(h, prev_emb)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= ATOL, f"{what}: max |ours - specforge| = {err:.3g} > {ATOL}"


HEAD_VARIANTS = [
    pytest.param(dict(markov_head_type="vanilla"), id="vanilla"),
    pytest.param(dict(markov_head_type="gated"), id="gated"),
    pytest.param(dict(markov_head_type="rnn"), id="rnn"),
    pytest.param(dict(confidence_head_with_markov=False), id="conf-no-markov"),
    pytest.param(dict(enable_confidence_head=False, confidence_head_with_markov=False), id="no-conf"),
]


@pytest.mark.parametrize("overrides", HEAD_VARIANTS)
def test_specforge_reads_our_config_and_weights(tmp_path, overrides):
    config = make_config(**overrides)
    ours = save_ours(config, tmp_path)
    sf = load_specforge(tmp_path)  # strict: no missing or unexpected key
    assert type(sf).__name__ == "DSparkDraftModel"
    assert list(sf.target_layer_ids) == config.target_layer_ids
    assert sf.mask_token_id == config.mask_token_id
    assert sf.block_size == config.block_size
    assert sf.markov_head.markov_head_type == config.markov_head_type
    assert sf.markov_head.markov_rank == config.markov_rank
    assert (sf.confidence_head is not None) == config.enable_confidence_head
    assert sf.confidence_head_with_markov == config.confidence_head_with_markov
    assert sf.config.rope_parameters["rope_theta"] == config.rope_theta
    assert sf.state_dict().keys() == ours.state_dict().keys()


def test_specforge_hf_loader_finds_every_tensor(tmp_path):
    """SpecForge's `AutoDraftModel.from_pretrained` (transformers loader) misses no tensor and adds none."""
    config = make_config(markov_head_type="gated")
    ours = save_ours(config, tmp_path)
    sf, info = sf_auto.AutoDraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(sf.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(num_key_value_heads=4), id="mha"),
    pytest.param(dict(num_target_layers=None), id="unknown-target-depth"),
])
def test_specforge_builds_edge_configs(tmp_path, overrides):
    """MHA drafts need dflash_config.attention_mode='mha' (specforge dspark.py:297-313), and SpecForge
    evaluates `num_target_layers` eagerly (dflash.py:356-359): the canonical config.json must carry both."""
    save_ours(make_config(**overrides), tmp_path)
    load_specforge(tmp_path)


def training_inputs(config: DSparkConfig, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    B, S = 2, 13
    ids = torch.randint(0, VOCAB - 1, (B, S), generator=g)
    aux = torch.randn(B, S, config.num_aux * HIDDEN, generator=g)
    anchors = torch.tensor([[0, 4, 8], [2, 3, 11]])  # overlapping blocks, one at position 0, one past S - γ
    return ids, aux, anchors


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("overrides", HEAD_VARIANTS[:3])
def test_training_forward_logits_match_specforge(tmp_path, overrides, attn):
    """All anchor blocks in one forward: ours (`forward_train`) vs SpecForge's draft under its own dense block
    mask (`create_dflash_sdpa_mask`), with the inputs its `OnlineDSparkModel` builds."""
    config = make_config(**overrides)
    ours = save_ours(config, tmp_path)
    sf = load_specforge(tmp_path, attn)
    embed, lm_head = target_heads(seed=2)
    ours.bind_target(embed, lm_head)
    ids, aux, anchors = training_inputs(config)
    (B, S), N, g = ids.shape, anchors.shape[1], config.block_size

    noise_ids = torch.full((B, N * g), sf.mask_token_id)  # dflash_family_model.py:220-243
    noise_ids[:, ::g] = ids.gather(1, anchors)
    block_pos = (anchors[..., None] + torch.arange(g)).flatten(1)  # :212-218
    position_ids = torch.cat((torch.arange(S).expand(B, S), block_pos), dim=1)  # :294-298
    mask = sf_family.create_dflash_sdpa_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), S, g, "cpu")
    # prev token of slot k is token a+k (teacher forcing, :1093-1097), clamped like SpecForge's labels
    prev = ids.gather(1, block_pos.clamp(max=S - 1)).view(B, N, g)

    with torch.no_grad():
        h_ours = ours.forward_train(ids, aux, anchors)
        h_sf = sf(position_ids=position_ids, attention_mask=mask, noise_embedding=embed(noise_ids),
                  target_hidden=aux).view(B, N, g, HIDDEN)
        base_sf = lm_head(h_sf)
        final_sf = sf.apply_logits_head(base_sf, prev_token_ids=prev, hidden_states=h_sf)
        final_ours = markov_logits(ours, h_ours, prev)
        assert (final_sf - base_sf).abs().max() > 100 * ATOL, "Markov bias too small to test"
        assert_close(h_ours, h_sf, "final hidden")
        assert_close(ours.base_logits(h_ours), base_sf, "base logits")
        assert_close(final_ours, final_sf, "Markov logits")
        assert_close(confidence_logits(ours, h_ours, prev), sf.predict_confidence(h_sf, prev_token_ids=prev),
                     "confidence logits")


@pytest.mark.parametrize("overrides", HEAD_VARIANTS[:3])
def test_inference_block_matches_specforge(tmp_path, overrides):
    """One block per request against a ragged, incrementally filled context cache (ours) vs SpecForge's
    forward as `spec_generate` calls it: context hidden states + block, no mask, positions 0..a+γ-1."""
    config = make_config(**overrides)
    ours = save_ours(config, tmp_path)
    sf = load_specforge(tmp_path)
    embed, lm_head = target_heads(seed=3)
    ours.bind_target(embed, lm_head)
    g = config.block_size
    gen = torch.Generator().manual_seed(4)
    aux = torch.randn(2, 9, config.num_aux * HIDDEN, generator=gen)
    anchors = torch.randint(0, VOCAB - 1, (2,), generator=gen)

    cache = DraftContextCache(ours, batch_size=2, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        cache.append(aux[:, :4], torch.tensor([4, 2]))  # prefill; then one decode step commits 3 and 4 more
        cache.append(torch.cat((aux[:1, 4:9], aux[1:, 2:7])), torch.tensor([3, 4]))
        h_ours = ours.forward_step(anchors, cache)
        proposal = rollout(ours, h_ours, anchors, temperature=0.0)
        contexts = [aux[0, :7], aux[1, :6]]  # each request's committed stream, ragged
        for b, ctx in enumerate(contexts):
            a = int(cache.lengths[b])
            assert a == ctx.shape[0]
            block_ids = torch.full((1, g), sf.mask_token_id)
            block_ids[0, 0] = anchors[b]
            h_sf = sf(position_ids=torch.arange(a + g)[None], noise_embedding=embed(block_ids),
                      target_hidden=ctx[None], is_causal=False)
            base_sf = lm_head(h_sf)
            assert_close(h_ours[b : b + 1], h_sf, f"request {b} final hidden")
            assert_close(ours.base_logits(h_ours[b : b + 1]), base_sf, f"request {b} base logits")
            # greedy Markov rollout from the anchor (dspark.py:82-117, 211-251): same tokens, same step logits
            tokens_sf, logits_sf = sf.markov_head.sample_block_tokens(
                base_sf, first_prev_token_ids=anchors[b : b + 1], hidden_states=h_sf, temperature=0.0)
            assert torch.equal(proposal.tokens[b : b + 1], tokens_sf), f"request {b} greedy tokens differ"
            assert_close(proposal.logits[b : b + 1], logits_sf, f"request {b} Markov logits")
            prev = torch.cat((anchors[b : b + 1, None], tokens_sf[:, :-1]), dim=1)
            assert_close(proposal.conf_logits[b : b + 1], sf.predict_confidence(h_sf, prev_token_ids=prev),
                         f"request {b} confidence logits")
