"""What the small-budget recipe leans on: warm start from target layers, the fc input scale, the RAM feature cache.

Each is checked for the property that makes it safe: the warm start really reproduces the target's layer on the
context path, the folded scale exports the function that was trained, and the cache returns exactly what the
engine returned without asking it twice.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.draft import DSparkDraft
from training.data import Sample
from training.objective import Batch, ObjectiveConfig
from training.sources import MemoryCachedSource
from training.tiny import build_tiny_target, mask_token_id
from training.trainer import ObjectiveModule, fold_aux_scale, param_groups
from training.warmstart import InitConfig, WarmStartError, init_from_draft, init_from_target, warm_start


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def draft_for(target, layers=2, ids=(0, 2)) -> DSparkDraft:
    return DSparkDraft(DSparkConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=404,
                                    block_size=4, mask_token_id=mask_token_id(target), markov_rank=8,
                                    target_layer_ids=list(ids), num_target_layers=4, rope_theta=10000.0))


def test_warm_start_copies_the_target_layer_and_feeds_it_its_own_input(target):
    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32)
    draft = draft_for(target, layers=1, ids=(0, 2))
    set_names = init_from_target(draft, target, [3])
    t = model.model.layers[3]
    d = draft.layers[0]
    assert torch.equal(d.mlp.down_proj.weight, t.mlp.down_proj.weight)
    assert torch.equal(d.self_attn.q_proj.weight, t.self_attn.q_proj.weight)
    assert torch.equal(draft.norm.weight, model.model.norm.weight)
    assert "layers.0.self_attn.q_norm.weight" not in set_names  # Llama has none: left at ones
    # Context path: hidden_norm(fc(aux)) must equal the target layer's own input_layernorm(output of layer 2).
    aux = torch.randn(1, 5, 2 * 32) * 7
    ctx = draft.project_context(aux)
    want = t.input_layernorm(aux[..., 32:])
    torch.testing.assert_close(ctx, want, rtol=1e-5, atol=1e-5)


def test_warm_start_errors_are_named(target):
    with pytest.raises(WarmStartError, match="names 1 layers but the draft has 2"):
        init_from_target(draft_for(target), target, [3])
    with pytest.raises(WarmStartError, match=r"must lie in \[0, 4\)"):
        init_from_target(draft_for(target), target, [3, 4])
    with pytest.raises(WarmStartError, match="no captured layer"):
        init_from_target(draft_for(target, ids=(1, 2)), target, [0, 1])
    with pytest.raises(WarmStartError, match="exclusive"):
        InitConfig(target_layers=[1, 2], draft="somewhere")


def test_init_from_draft_is_exact_and_checks_the_config(target, tmp_path):
    src = draft_for(target)
    src.reset_parameters()
    src.config.sts_temperatures = [1.5] * 4  # a calibrated draft still warm-starts a fresh config
    src.save_pretrained(tmp_path / "d")
    dst = draft_for(target)
    assert "initialised from" in warm_start(dst, InitConfig(draft=str(tmp_path / "d")), target)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    other = draft_for(target, ids=(1, 2))
    with pytest.raises(WarmStartError, match="another config"):
        init_from_draft(other, tmp_path / "d")


def test_folded_aux_scale_exports_the_trained_function(target):
    draft = draft_for(target)
    draft.reset_parameters()
    module = ObjectiveModule(draft, ObjectiveConfig(num_anchors=4), scale_aux=True)
    module.aux_inv_scale.copy_(torch.rand(64) + 0.1)
    aux = torch.randn(2, 6, 64) * 30
    trained = draft.project_context(aux * module.aux_inv_scale)  # what the trainer computes
    exported = draft_for(target)
    exported.load_state_dict(fold_aux_scale(module.state_dict()), strict=True)
    torch.testing.assert_close(exported.project_context(aux), trained, rtol=1e-5, atol=1e-5)


class CountingSource:
    """A fake engine: deterministic features from the ids, counting what it is asked to capture."""

    def __init__(self):
        self.pad_id, self.captured, self.submitted = 0, [], []

    def submit(self, items):
        self.submitted += [s.id for _, s in items]

    def batch(self, items, device):
        self.captured += [s.id for _, s in items]
        S = max(len(s.input_ids) for _, s in items)
        ids = torch.zeros(len(items), S, dtype=torch.long)
        for b, (_, s) in enumerate(items):
            ids[b, : len(s.input_ids)] = torch.tensor(s.input_ids)
        lengths = torch.tensor([len(s.input_ids) for _, s in items])
        feats = ids[..., None].float() * torch.arange(1, 4)
        return Batch(ids, ids > 0, lengths, torch.tensor([s.id for _, s in items]), feats.repeat(1, 1, 2), feats)

    def pending(self):
        return []

    def close(self):
        pass


def test_memory_cache_serves_repeats_without_the_engine():
    samples = [Sample(i, list(range(1, 4 + i)), [True] * (3 + i)) for i in range(4)]
    inner = CountingSource()
    src = MemoryCachedSource(inner, budget_bytes=10**9)
    first = src.batch([(0, samples[0]), (1, samples[2])], "cpu")
    src.submit([(0, samples[0]), (1, samples[1])])
    assert inner.submitted == [1]  # sample 0 is cached: never requested again
    again = src.batch([(0, samples[2]), (1, samples[1]), (2, samples[0])], "cpu")
    assert inner.captured == [0, 2, 1]
    assert torch.equal(again.aux_hidden[0, :5], first.aux_hidden[1, :5])
    assert torch.equal(again.last_hidden[2, :3], first.last_hidden[0, :3])
    assert again.lengths.tolist() == [5, 4, 3] and again.sample_ids.tolist() == [2, 1, 0]
    assert torch.equal(again.input_ids[2], torch.tensor([1, 2, 3, 0, 0]))


def test_memory_cache_respects_its_budget():
    samples = [Sample(i, [1, 2, 3], [True] * 3) for i in range(3)]
    inner = CountingSource()
    one_row = 3 * 8 + 3 * 1 + 3 * 6 * 4 + 3 * 3 * 4  # ids, mask, aux, last bytes of a 3-token sample
    src = MemoryCachedSource(inner, budget_bytes=one_row)
    src.batch([(0, s) for s in samples], "cpu")
    src.batch([(0, s) for s in samples], "cpu")
    assert inner.captured == [0, 1, 2, 1, 2]  # only the first sample fitted
    assert src.used == one_row


def test_recipe_sections_reach_the_trainer(tmp_path):
    from training.recipe import RecipeError, load_recipe

    r = load_recipe(None, ["init.target_layers=[1,2]", "stream.memory_cache_mb=64", "optim.scale_aux=true"])
    assert r.init.target_layers == [1, 2] and r.stream.memory_cache_mb == 64.0 and r.optim.scale_aux
    with pytest.raises(RecipeError, match="exclusive"):
        load_recipe(None, ["init.target_layers=[1,2]", "init.draft=x"])
    json.dumps(r.to_dict())


def test_lr_scale_moves_each_draft_module_at_its_multiplier(target):
    """`optim.lr_scale` (issue 40's per-group LR lever): AdamW's first step moves every weight by its group's LR
    (|update| = lr for a nonzero gradient), so each module moves at lr x its multiplier and the rest at lr; every
    trainable parameter is in exactly one group; a key naming no module is one clear error; a multiplier <= 0 is
    refused by the recipe."""
    from training.recipe import RecipeError, load_recipe

    module = ObjectiveModule(draft_for(target), ObjectiveConfig())
    groups = param_groups(module, 1e-2, {"markov_head": 0.25, "layers": 2.0})
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert sorted(map(id, (p for g in groups for p in g["params"]))) == sorted(map(id, trainable))
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    for p in trainable:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0).step()
    moved = {n.split(".")[1]: (p.detach() - before[n]).abs().max().item()
             for n, p in module.named_parameters() if p.requires_grad}
    assert moved["markov_head"] == pytest.approx(2.5e-3, rel=1e-3) and moved["layers"] == pytest.approx(2e-2, rel=1e-3)
    assert moved["fc"] == pytest.approx(1e-2, rel=1e-3) and moved["confidence_head"] == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(RecipeError, match="markov_heads.*markov_head"):
        param_groups(module, 1e-2, {"markov_heads": 0.5})
    assert load_recipe(None, ["optim.lr_scale={markov_head: 0.25}"]).optim.lr_scale == {"markov_head": 0.25}
    with pytest.raises(RecipeError, match="lr_scale.fc.*greater than 0"):
        load_recipe(None, ["optim.lr_scale={fc: 0}"])
