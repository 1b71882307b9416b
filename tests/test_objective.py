"""The training objective against a slow, obviously-correct implementation (python loops over blocks and slots).

Covers anchors (validity, uniformity, seeding), labels a+k+1, the prefix mask, w_k = exp(-k/γ_decay), teacher-forced
Markov logits, CE / L1 / BCE with the detached soft label, pooled normalisation across accumulation micro-steps and
across 2 gloo ranks, chunking, bounded saved memory, and SpecForge 0.2.0's own DSpark objective on the same inputs.
"""

from __future__ import annotations

import math
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dspark_sgl.config import DSparkConfig
from dspark_sgl.model.draft import DSparkDraft
from tests.conftest import require
from training.objective import (
    STAT_NAMES,
    Batch,
    ObjectiveConfig,
    VocabLoss,
    anchor_seed,
    compute_objective,
    normalise_gradients,
    sample_anchors,
    summarise,
)

V, H, GAMMA = 61, 32, 4


def make_draft(seed: int = 0, **overrides) -> DSparkDraft:
    kw = dict(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=V, block_size=GAMMA, target_layer_ids=[0, 1], mask_token_id=V - 1,
        markov_rank=8, rope_theta=1000.0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    draft = DSparkDraft(DSparkConfig(**kw))
    with torch.no_grad():  # O(1) weights so every term has a visible gradient
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]) if "markov_w1" not in name else 1.0)
    embed, lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    nn.init.normal_(lm_head.weight, std=1.5 / math.sqrt(H))
    embed.requires_grad_(False), lm_head.requires_grad_(False)
    return draft.bind_target(embed, lm_head)


def make_batch(seed: int = 1, B: int = 3, S: int = 22, ids_offset: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([S, S - 5, S - 9][:B])
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):  # prompt, answer, a gap (second user turn), answer
        L = int(lengths[b])
        mask[b, 4:L // 2] = True
        mask[b, L // 2 + 3:L] = True
    return Batch(
        input_ids=torch.randint(0, V - 1, (B, S), generator=g),
        loss_mask=mask,
        lengths=lengths,
        sample_ids=torch.arange(B) + ids_offset,
        aux_hidden=torch.randn(B, S, 2 * H, generator=g),
        last_hidden=torch.randn(B, S, H, generator=g),
    )


def anchors_for(batch: Batch, step: int = 0, num_anchors: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = [anchor_seed(42, step, int(i)) for i in batch.sample_ids]
    return sample_anchors(batch.loss_mask, batch.lengths, num_anchors, seeds)


# ---- the slow reference ------------------------------------------------------------------------------------
def slow_objective(draft: DSparkDraft, batch: Batch, anchors, valid, cfg: ObjectiveConfig):
    """Python loops over (row, anchor, slot); every term written out from its definition. Returns (num, Σw)."""
    num = torch.zeros(())
    wsum = 0.0
    h = draft.forward_train(batch.input_ids, batch.aux_hidden, anchors)
    lm = draft.target.lm_head
    for b in range(anchors.shape[0]):
        L = int(batch.lengths[b])
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            assert batch.loss_mask[b, a] and batch.loss_mask[b, a + 1]
            for k in range(GAMMA):
                label_pos = a + k + 1
                if label_pos >= L or not all(batch.loss_mask[b, a + j + 1] for j in range(k + 1)):
                    break  # prefix-contiguous: the first unsupervised label ends the block
                w = math.exp(-k / cfg.gamma_decay)
                prev = batch.input_ids[b, a + k]
                hk = h[b, n, k]
                latent = draft.markov_head.teacher_forced_latent(
                    batch.input_ids[b, a:a + k + 1], h[b, n, :k + 1])[-1]
                logits = lm(hk).float() + draft.markov_head.bias(latent).float()
                label = batch.input_ids[b, label_pos]
                ce = -torch.log_softmax(logits, -1)[label]
                p_draft = torch.softmax(logits, -1)
                p_target = torch.softmax(lm(batch.last_hidden[b, a + k]).float(), -1)  # predicts label_pos
                l1 = (p_draft - p_target).abs().sum()
                alpha = (1 - l1.detach() / 2).clamp(0, 1)
                z = draft.confidence_head(hk[None], draft.markov_head.markov_w1(prev[None]))[0]
                bce = -(alpha * torch.log(torch.sigmoid(z)) + (1 - alpha) * torch.log(1 - torch.sigmoid(z)))
                num = num + w * (cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.bce_weight * bce)
                wsum += w
    return num, wsum


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, atol=1e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


# ---- anchors -----------------------------------------------------------------------------------------------
def test_anchors_are_valid_sorted_unique_and_capped():
    batch = make_batch()
    anchors, valid = anchors_for(batch, num_anchors=5)
    assert anchors.shape == (3, 5)
    for b in range(3):
        got = anchors[b][valid[b]].tolist()
        assert got == sorted(set(got)), "sorted, without replacement"
        L = int(batch.lengths[b])
        allowed = {p for p in range(L - 1) if batch.loss_mask[b, p] and batch.loss_mask[b, p + 1]}
        assert set(got) <= allowed
        assert len(got) == min(5, len(allowed))


def test_anchors_short_row_gets_all_its_positions_and_padding_is_masked():
    batch = make_batch()
    batch.loss_mask[2] = False
    batch.loss_mask[2, 5:8] = True  # exactly two valid anchors: 5, 6
    anchors, valid = anchors_for(batch, num_anchors=6)
    assert anchors[2][valid[2]].tolist() == [5, 6]
    assert (anchors[2][~valid[2]] == 0).all()


def test_anchors_are_uniform_without_replacement():
    S, draws, N = 12, 4000, 3
    mask = torch.ones(1, S, dtype=torch.bool)
    counts = torch.zeros(S - 1)
    for i in range(draws):
        a, v = sample_anchors(mask, torch.tensor([S]), N, [anchor_seed(0, i, 7)])
        counts[a[0][v[0]]] += 1
    expected = draws * N / (S - 1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35, f"anchor positions are not uniform: chi2={chi2:.1f} over {S - 1} bins"  # df=10, p≈1e-4


def test_anchors_differ_by_step_and_sample_and_ignore_batch_padding():
    batch = make_batch()
    a0, _ = anchors_for(batch, step=0)
    a1, _ = anchors_for(batch, step=1)
    assert not torch.equal(a0, a1), "same anchors at two steps"
    other = make_batch(ids_offset=100)  # same tokens, other sample ids (another rank's samples)
    assert not torch.equal(a0, anchors_for(other)[0])
    # the same row padded to a longer batch draws the same anchors
    padded = Batch(**{f: getattr(batch, f) for f in batch.__dataclass_fields__})
    padded.loss_mask = F.pad(batch.loss_mask, (0, 9))
    single = sample_anchors(padded.loss_mask[1:2], batch.lengths[1:2], 6, [anchor_seed(42, 0, 1)])
    assert torch.equal(single[0][single[1]], a0[1][anchors_for(batch)[1][1]])


# ---- loss terms vs the slow reference ----------------------------------------------------------------------
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_objective_matches_slow_reference(head, chunk):
    cfg = ObjectiveConfig(num_anchors=6, gamma_decay=2.5, vocab_chunk_rows=chunk)
    batch = make_batch()
    anchors, valid = anchors_for(batch)
    draft = make_draft(markov_head_type=head)
    out = compute_objective(draft, batch, anchors, valid, cfg)
    out.numerator.backward()
    fast = grads(draft)
    draft.zero_grad(set_to_none=True)
    ref_num, ref_w = slow_objective(draft, batch, anchors, valid, cfg)
    ref_num.backward()
    torch.testing.assert_close(out.numerator.detach(), ref_num.detach(), atol=1e-5, rtol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref_w, rel=1e-6)
    assert_grads_close(fast, grads(draft))
    assert fast["markov_head.markov_w2.weight"].abs().sum() > 0 and fast["confidence_head.proj.weight"].abs().sum() > 0


def test_objective_weights_and_loss_mixture():
    """Changing one weight changes the numerator by exactly that weight times its term."""
    batch = make_batch()
    anchors, valid = anchors_for(batch)
    draft = make_draft()
    base = ObjectiveConfig(num_anchors=6, ce_weight=0, l1_weight=0, bce_weight=0)
    parts = {}
    for term in ("ce_weight", "l1_weight", "bce_weight"):
        cfg = ObjectiveConfig(num_anchors=6, **{term: 1.0, **{t: 0.0 for t in ("ce_weight", "l1_weight",
                                                                               "bce_weight") if t != term}})
        parts[term] = float(compute_objective(draft, batch, anchors, valid, cfg).numerator.detach())
    assert float(compute_objective(draft, batch, anchors, valid, base).numerator.detach()) == 0
    full = float(compute_objective(draft, batch, anchors, valid, ObjectiveConfig(num_anchors=6)).numerator.detach())
    assert full == pytest.approx(0.1 * parts["ce_weight"] + 0.9 * parts["l1_weight"] + parts["bce_weight"], rel=1e-5)
    assert all(v > 0 for v in parts.values())


def test_position_decay_and_prefix_mask_in_stats():
    cfg = ObjectiveConfig(num_anchors=6, gamma_decay=4.0)
    batch = make_batch()
    anchors, valid = anchors_for(batch)
    stats = compute_objective(make_draft(), batch, anchors, valid, cfg).stats
    s = dict(zip(STAT_NAMES, stats, strict=True))
    per_slot_w = s["weight"] / s["count"]
    torch.testing.assert_close(per_slot_w, torch.exp(-torch.arange(GAMMA) / 4.0))
    assert (s["count"][1:] <= s["count"][:-1]).all(), "prefix mask: later slots are never counted more"
    assert s["count"][0] == valid.sum()  # slot 0 of every valid anchor is supervised by construction
    m = summarise(stats)
    assert 1.0 <= m["tau_prob"] <= 1 + GAMMA and 0 <= m["acc"] <= 1


def test_confidence_label_is_detached():
    """The BCE target must not push the draft's distribution: with only BCE on, W2 (which feeds only the logits,
    i.e. only the soft label) receives no gradient."""
    batch = make_batch()
    anchors, valid = anchors_for(batch)
    draft = make_draft()
    cfg = ObjectiveConfig(num_anchors=6, ce_weight=0, l1_weight=0, bce_weight=1.0)
    compute_objective(draft, batch, anchors, valid, cfg).numerator.backward()
    assert draft.markov_head.markov_w2.weight.grad.abs().max() == 0
    assert draft.confidence_head.proj.weight.grad.abs().max() > 0


def test_ce_against_the_teacher_argmax(monkeypatch):
    """`ce_target: teacher` = the labels objective with every label replaced by the target's argmax at a+k, that
    argmax computed here on its own (the full head on `last_hidden`); and its `correct` is then the `agree` stat."""
    import training.objective as obj

    batch = make_batch()
    anchors, valid = anchors_for(batch)
    draft = make_draft()
    cfg = ObjectiveConfig(num_anchors=6, gamma_decay=2.5, vocab_chunk_rows=5, ce_target="teacher")
    out = compute_objective(draft, batch, anchors, valid, cfg)
    out.numerator.backward()
    fast = grads(draft)
    draft.zero_grad(set_to_none=True)
    argmax_at = (batch.last_hidden @ draft.target.lm_head.weight.t()).argmax(-1)  # [B, S]: the target's x̂_{p+1}
    real = obj.block_targets

    def teacher_labels(b, a, v, gamma):
        labels, prev, mask = real(b, a, v, gamma)
        pos = (a[..., None] + torch.arange(gamma)).clamp(max=b.input_ids.shape[1] - 1)
        return argmax_at.gather(1, pos.flatten(1)).view_as(labels), prev, mask

    monkeypatch.setattr(obj, "block_targets", teacher_labels)
    ref = compute_objective(draft, batch, anchors, valid, ObjectiveConfig(num_anchors=6, gamma_decay=2.5))
    ref.numerator.backward()
    torch.testing.assert_close(out.numerator.detach(), ref.numerator.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(fast, grads(draft))
    s = dict(zip(STAT_NAMES, out.stats, strict=True))
    assert torch.equal(s["correct"], s["agree"])
    monkeypatch.undo()
    labels_out = compute_objective(draft, batch, anchors, valid, ObjectiveConfig(num_anchors=6, gamma_decay=2.5))
    changed = float(labels_out.numerator.detach()) != pytest.approx(float(out.numerator.detach()), rel=1e-3)
    assert changed  # the lever changes the loss
    with pytest.raises(ValueError, match="ce_target"):
        ObjectiveConfig(ce_target="argmax")


def test_confidence_detach_keeps_the_backbone_out_of_bce():
    """With only BCE on, the trunk gets a gradient unless `confidence_detach`; the confidence head learns either way."""
    batch = make_batch()
    anchors, valid = anchors_for(batch)
    trunk = {}
    for detach in (False, True):
        draft = make_draft()
        cfg = ObjectiveConfig(num_anchors=6, ce_weight=0, l1_weight=0, bce_weight=1.0, confidence_detach=detach)
        compute_objective(draft, batch, anchors, valid, cfg).numerator.backward()
        assert draft.confidence_head.proj.weight.grad.abs().max() > 0
        trunk[detach] = max(float(p.grad.abs().max()) for n, p in draft.named_parameters()
                            if n.startswith("layers.") and p.grad is not None)
    assert trunk[False] > 0 and trunk[True] == 0


def test_vocab_loss_saves_no_vocab_sized_activation():
    """Peak memory is one chunk: nothing of shape [rows, V] is kept for backward, whatever the number of rows."""
    R, r = 300, 8
    h = torch.randn(R, H, requires_grad=True)
    lat = torch.randn(R, r, requires_grad=True)
    w2 = torch.randn(V, r, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        total, *_ = VocabLoss.apply(h, lat, w2, torch.randn(V, H), torch.randn(R, H), torch.randint(0, V, (R,)),
                                    torch.ones(R), 0.1, 0.9, 16)
    total.backward()
    assert max(saved) <= max(R * H, V * r) and max(saved) < R * V


# ---- pooled normalisation ----------------------------------------------------------------------------------
def pooled_reference(batches, cfg):
    """Gradient of (Σ over all micro-batches of the numerators) / (Σ of all weights): one loss over everything."""
    draft = make_draft()
    total_num, total_w = 0, 0.0
    for step_batch in batches:
        a, v = anchors_for(step_batch)
        out = compute_objective(draft, step_batch, a, v, cfg)
        total_num, total_w = total_num + out.numerator, total_w + float(out.weight_sum)
    (total_num / total_w).backward()
    return grads(draft)


def test_accumulation_pools_the_normalisation():
    cfg = ObjectiveConfig(num_anchors=6)
    micro = [make_batch(seed=1), make_batch(seed=2, B=2, S=15, ids_offset=10)]
    draft = make_draft()
    wsum = torch.zeros(())
    for mb in micro:
        a, v = anchors_for(mb)
        out = compute_objective(draft, mb, a, v, cfg)
        out.numerator.backward()
        wsum += out.weight_sum
    normalise_gradients(draft.parameters(), wsum)
    assert_grads_close(grads(draft), pooled_reference(micro, cfg))
    # and it differs from averaging per-micro-batch means (the peer's un-pooled accumulation)
    naive = make_draft()
    for mb in micro:
        a, v = anchors_for(mb)
        out = compute_objective(naive, mb, a, v, cfg)
        (out.numerator / out.weight_sum / len(micro)).backward()
    g_naive, g_pooled = grads(naive)["fc.weight"], grads(draft)["fc.weight"]
    assert (g_naive - g_pooled).abs().max() > 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, port: int, out_file: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cfg = ObjectiveConfig(num_anchors=6)
    mb = [make_batch(seed=1), make_batch(seed=2, B=2, S=15, ids_offset=10)][rank]
    draft = make_draft()
    a, v = anchors_for(mb)
    out = compute_objective(draft, mb, a, v, cfg)
    out.numerator.backward()
    wsum = out.weight_sum.clone()
    dist.all_reduce(wsum)
    for p in draft.parameters():
        dist.all_reduce(p.grad)  # plain sum across ranks
    normalise_gradients(draft.parameters(), wsum)
    if rank == 0:
        torch.save(grads(draft), out_file)
    dist.destroy_process_group()


def test_two_ranks_pool_the_normalisation(tmp_path):
    out = str(tmp_path / "g.pt")
    mp.spawn(_rank_worker, args=(_free_port(), out), nprocs=2)
    cfg = ObjectiveConfig(num_anchors=6)
    expected = pooled_reference([make_batch(seed=1), make_batch(seed=2, B=2, S=15, ids_offset=10)], cfg)
    assert_grads_close(torch.load(out), expected)


def test_empty_step_is_a_clear_error():
    with pytest.raises(ValueError, match="no supervised slot"):
        normalise_gradients([], torch.zeros(()))


def test_bad_objective_config():
    with pytest.raises(ValueError, match="gamma_decay"):
        ObjectiveConfig(gamma_decay=0)
    with pytest.raises(ValueError, match="num_anchors"):
        ObjectiveConfig(num_anchors=0)


# ---- SpecForge 0.2.0's own objective -----------------------------------------------------------------------
def test_matches_specforge_objective(tmp_path):
    """Same weights, inputs and anchors: SpecForge's OnlineDSparkModel loss (1 rank, 1 micro-batch, where its
    normalisation equals ours) and every draft gradient."""
    require("specforge")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
        from specforge.modeling import auto as sf_auto
    from safetensors.torch import load_file

    draft = make_draft(num_target_layers=4)
    draft.save_pretrained(tmp_path)
    conf = sf_auto.AutoDraftModelConfig.from_file(str(tmp_path / "config.json"))
    conf._attn_implementation = "sdpa"
    sf_draft = sf_auto.AutoDraftModel.from_config(conf).float()
    sf_draft.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    cfg = ObjectiveConfig(num_anchors=6, gamma_decay=4.0)
    batch = make_batch()
    batch.loss_mask &= torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    anchors, valid = anchors_for(batch)
    sf = OnlineDSparkModel(sf_draft, draft.target.lm_head, draft.target.embed_tokens, V - 1, block_size=GAMMA,
                           attention_backend="sdpa", num_anchors=6, loss_decay_gamma=4.0)
    sf._sample_anchor_positions = lambda *_: (anchors, valid)
    sf_loss, _, _ = sf(batch.input_ids, batch.aux_hidden, batch.loss_mask.float(), batch.last_hidden)
    sf_loss.backward()
    out = compute_objective(draft, batch, anchors, valid, cfg)
    (out.numerator / out.weight_sum).backward()
    torch.testing.assert_close((out.numerator / out.weight_sum).detach(), sf_loss.detach(), atol=1e-5, rtol=1e-5)
    sf_grads = {n: p.grad for n, p in sf_draft.named_parameters() if p.grad is not None}
    assert_grads_close(grads(draft), sf_grads, atol=1e-5, rtol=1e-3)
