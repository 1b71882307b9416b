"""The sparse teacher (objective.teacher_topk): top-k of the target's distribution + the lumped rest.

Checked at the VocabLoss level against autograd on the formula written out, for the full and the reduced draft
vocabulary: with k covering the vocabulary it is the exact objective; with a small k it is L1 over the partition
{each top-k token} ∪ {the rest}, a lower bound of the exact L1 within 2·rest. Then end to end: the objective and
its gradients through `compute_objective`, and the trainer's cached source storing the teacher instead of the
target's hidden states.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_objective import GAMMA, V, anchors_for, make_batch, make_draft
from training.objective import ObjectiveConfig, Teacher, VocabLoss, compute_objective, sparse_teacher

R, H, RANK = 37, 16, 6


def rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g)
    latent = torch.randn(R, RANK, generator=g)
    w2 = torch.randn(V, RANK, generator=g) / RANK**0.5
    lm = torch.randn(V, H, generator=g) * 1.5 / H**0.5
    tgt = torch.randn(R, H, generator=g) * 2
    labels = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g) + 0.5
    return h, latent, w2, lm, tgt, labels, w


def vocab_loss(h, latent, w2, lm, tgt, labels, w, teacher=None, vocab=None, lm_full=None, chunk=8):
    h, latent, w2 = (t.clone().requires_grad_() for t in (h, latent, w2))
    label_idx = None
    if vocab is not None:
        index = torch.full((lm_full.shape[0],), -1, dtype=torch.long)
        index[vocab] = torch.arange(vocab.shape[0])
        label_idx = index[labels]
    total, ce, l1, _, agree = VocabLoss.apply(h, latent, w2, lm, None if teacher is not None else tgt, labels, w,
                                              0.1, 0.9, chunk, lm_full, vocab, label_idx, teacher)
    total.backward()
    return total.detach(), l1, agree, (h.grad, latent.grad, w2.grad)


def reference(h, latent, w2, lm, labels, w, teacher: Teacher, vocab=None):
    """0.1·Σw·CE + 0.9·Σw·L1 by autograd, L1 over {top-k tokens} ∪ {the rest} written out row by row."""
    h, latent, w2 = (t.clone().requires_grad_() for t in (h, latent, w2))
    logits = h @ lm.t() + latent @ w2.t()  # over the draft's columns (K of them when vocab is given)
    p = logits.softmax(-1)
    cols = list(range(lm.shape[0])) if vocab is None else vocab.tolist()
    total, l1s = 0.0, []
    for r in range(h.shape[0]):
        listed = {int(t): float(q) for t, q in zip(teacher.ids[r], teacher.probs[r], strict=True)}
        l1 = sum(abs(listed[t]) for t in listed if t not in cols)  # listed target mass the draft cannot propose
        rest_p = 0.0
        for j, t in enumerate(cols):
            if t in listed:
                l1 = l1 + (p[r, j] - listed[t]).abs()
            else:
                rest_p = rest_p + p[r, j]
        l1 = l1 + (rest_p - teacher.rest[r]).abs()
        y = int(labels[r])
        ce = -torch.log(p[r, cols.index(y)]) if y in cols else 0.0
        total = total + w[r] * (0.1 * ce + 0.9 * l1)
        l1s.append(float(l1.detach()) if torch.is_tensor(l1) else l1)
    total.backward()
    return total.detach(), torch.tensor(l1s), (h.grad, latent.grad, w2.grad)


def assert_same(a, b, atol=1e-5, rtol=1e-4):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def test_sparse_teacher_is_top_k_and_rest():
    h, *_ = rows()
    lm = torch.randn(V, H)
    t = sparse_teacher(h, lm, 5, chunk=7)
    p = F.softmax(h @ lm.t(), -1)
    top = p.topk(5, -1)
    assert torch.equal(t.ids, top.indices)
    torch.testing.assert_close(t.probs, top.values)
    torch.testing.assert_close(t.rest, 1 - top.values.sum(-1))


@pytest.mark.parametrize("k", [3, 9])
@pytest.mark.parametrize("draft_near_target", [False, True])
def test_small_k_equals_the_lumped_reference(k, draft_near_target):
    h, latent, w2, lm, tgt, labels, w = rows(1)
    if draft_near_target:  # P_rest falls on both sides of rest: the lumped tail's sign matters
        h, latent = tgt + 0.3 * torch.randn(R, H, generator=torch.Generator().manual_seed(5)), latent * 0.1
    teacher = sparse_teacher(tgt, lm, k)
    total, l1, _, g = vocab_loss(h, latent, w2, lm, tgt, labels, w, teacher=teacher)
    ref_total, ref_l1, ref_g = reference(h, latent, w2, lm, labels, w, teacher)
    torch.testing.assert_close(total, ref_total, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(l1, ref_l1, atol=1e-5, rtol=1e-5)
    assert_same(g, ref_g)


def test_small_k_with_a_reduced_vocabulary_equals_the_lumped_reference():
    h, latent, w2, lm, tgt, labels, w = rows(2)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:24].sort().values
    teacher = sparse_teacher(tgt, lm, 7)  # some top-k tokens fall outside the draft's 24
    assert (~torch.isin(teacher.ids, vocab)).any() and torch.isin(teacher.ids, vocab).any()
    total, l1, _, g = vocab_loss(h, latent, w2[vocab], lm[vocab], tgt, labels, w, teacher=teacher, vocab=vocab,
                                 lm_full=lm)
    ref_total, ref_l1, ref_g = reference(h, latent, w2[vocab], lm[vocab], labels, w, teacher, vocab=vocab)
    torch.testing.assert_close(total, ref_total, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(l1, ref_l1, atol=1e-5, rtol=1e-5)
    assert_same(g, ref_g)


@pytest.mark.parametrize("reduced", [False, True])
def test_k_covering_the_vocabulary_is_the_exact_objective(reduced):
    h, latent, w2, lm, tgt, labels, w = rows(3)
    kw = {}
    if reduced:
        vocab = torch.arange(0, V, 2)
        kw = dict(vocab=vocab, lm_full=lm)
        w2, lm_d = w2[vocab], lm[vocab]
    else:
        lm_d = lm
    exact = vocab_loss(h, latent, w2, lm_d, tgt, labels, w, **kw)
    sparse = vocab_loss(h, latent, w2, lm_d, tgt, labels, w, teacher=sparse_teacher(tgt, lm, V), **kw)
    torch.testing.assert_close(sparse[0], exact[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(sparse[1], exact[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(sparse[2], exact[2])  # teacher agreement: same argmax
    assert_same(sparse[3], exact[3])


def test_small_k_is_a_lower_bound_within_twice_the_rest():
    h, latent, w2, lm, tgt, labels, w = rows(4)
    teacher = sparse_teacher(tgt, lm, 4)
    _, exact_l1, _, _ = vocab_loss(h, latent, w2, lm, tgt, labels, w)
    _, l1, _, _ = vocab_loss(h, latent, w2, lm, tgt, labels, w, teacher=teacher)
    assert (l1 <= exact_l1 + 1e-5).all()
    assert (exact_l1 <= l1 + 2 * teacher.rest + 1e-5).all()
    assert (l1 < exact_l1 - 1e-3).any()  # a real approximation at k = 4, not the exact value by accident


def test_compute_objective_with_a_teacher_batch():
    """Through the whole objective: a batch carrying a k = V teacher instead of hidden states gives the same loss
    and gradients as the exact one."""
    draft, batch = make_draft(), make_batch()
    anchors, valid = anchors_for(batch)
    cfg = ObjectiveConfig(num_anchors=6)
    out = compute_objective(draft, batch, anchors, valid, cfg)
    out.numerator.backward()
    exact = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    B, S, _ = batch.last_hidden.shape
    t = sparse_teacher(batch.last_hidden.flatten(0, 1), draft.target.lm_head.weight, V)
    batch.teacher = Teacher(t.ids.view(B, S, V), t.probs.view(B, S, V), t.rest.view(B, S))
    batch.last_hidden = None
    out2 = compute_objective(draft, batch, anchors, valid, cfg)
    out2.numerator.backward()
    torch.testing.assert_close(out2.numerator, out.numerator, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out2.stats, out.stats, atol=1e-4, rtol=1e-4)
    for n, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, exact[n], atol=1e-5, rtol=1e-4, msg=n)
    assert GAMMA == out.stats.shape[1]
