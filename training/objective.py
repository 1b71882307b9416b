"""The DSpark training objective: the one loss file (trainer, tests and benchmarks all import it).

Per sequence, anchors a are sampled among positions p with loss_mask[p] and loss_mask[p + 1]; each anchor opens a
block whose slot k (0 ≤ k < γ) predicts token a+k+1. All blocks of a sequence run in ONE draft forward
(`DSparkDraft.forward_train`). A slot counts while every label up to it is supervised (prefix-contiguous mask) and is
weighted w_k = exp(−k/γ_decay). With teacher-forced Markov input prev_k = token a+k:

    logits_k = lm_head(h_k) + W2 · latent(prev_k, h_k)                       (fp32)
    CE_k     = −log softmax(logits_k)[x_{a+k+1}]
    L1_k     = Σ_v |softmax(logits_k) − softmax(lm_head(target_last_hidden[a+k]))|   (fp32, target frozen)
    BCE_k    = BCE(confidence_logit_k, detach(clamp(1 − L1_k/2, 0, 1)))
    loss     = (0.1·Σ w·CE + 0.9·Σ w·L1 + 1.0·Σ w·BCE) / Σ w

Σw is pooled over every micro-batch of an optimizer step on every rank. We get that exactly by back-propagating the
unnormalised numerator of each micro-batch and dividing the summed gradients by the global Σw once, after the last
micro-batch (`normalise_gradients`): gradients are linear in the loss, so this is the same gradient without having
to know Σw before the first backward.

The full-vocabulary part runs in `VocabLoss`, a fused autograd function that walks the rows in chunks and computes
the gradient of each chunk while its logits are alive, so peak memory is one chunk of [rows, V] fp32 buffers whatever
the number of anchors, and nothing is recomputed in backward (SpecForge checkpoints 128-block chunks and recomputes).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_sgl.kernels.markov_step import markov_step
from dspark_sgl.model.draft import DSparkDraft

# Rows of the per-position statistics tensor returned by `compute_objective` (each row has γ columns).
STAT_NAMES = ("count", "weight", "ce", "l1", "bce", "correct", "agree", "conf_abs_err", "alpha_prefix")


@dataclass
class ObjectiveConfig:
    num_anchors: int = 512
    gamma_decay: float = 4.0  # w_k = exp(-k / gamma_decay), k = 0 .. γ-1
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    bce_weight: float = 1.0
    vocab_chunk_rows: int = 256  # rows of [rows, V] fp32 buffers alive at once
    # 0: the target's exact distribution per row (its V-wide head on every supervised slot). k > 0: a sparse
    # teacher, computed once per sample position (and cached with the capture across epochs): the k most likely
    # tokens plus the mass of the rest, scored as one lumped token (see `Teacher`).
    teacher_topk: int = 0
    # What CE is measured against: "labels", the sample's next token (a human token on prefilled chat), or
    # "teacher", the target's own most likely next token (what a T=0 verify accepts; on regenerated samples the
    # two agree). Issue 40's lever 2: benchmarks/results/ablation_levers_xeon.json.
    ce_target: str = "labels"
    # Detach the backbone from the confidence BCE: the confidence head still learns, the shared trunk is trained by
    # CE and L1 alone (issue 40's lever 4, same result file).
    confidence_detach: bool = False

    def __post_init__(self) -> None:
        if self.ce_target not in ("labels", "teacher"):
            raise ValueError(f"ce_target must be 'labels' or 'teacher', got {self.ce_target!r}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.gamma_decay <= 0:
            raise ValueError(f"gamma_decay must be > 0, got {self.gamma_decay}")
        if self.vocab_chunk_rows < 1:
            raise ValueError(f"vocab_chunk_rows must be >= 1, got {self.vocab_chunk_rows}")
        if self.teacher_topk < 0:
            raise ValueError(f"teacher_topk must be >= 0 (0 = exact), got {self.teacher_topk}")
        if min(self.ce_weight, self.l1_weight, self.bce_weight) < 0:
            raise ValueError("loss weights must be >= 0")


@dataclass
class Teacher:
    """The target's next-token distribution at each position, kept sparse: its k most likely tokens and the rest.

    Why: the target is frozen, so its distribution at a position never changes, yet the exact objective recomputes
    it (a V-wide head, ~15 V-wide elementwise passes) for every supervised slot of every anchor of every epoch. Kept
    as top-k (ids, probs) + the remaining mass, it costs k·8 bytes per position and is computed once per sample.
    The objective scores L1 over the partition {each top-k token} ∪ {everything else, lumped}: a lower bound of the
    exact L1 that is short by at most 2·rest, and exact when k covers the support (tests/test_objective.py).
    """

    ids: Tensor  # [..., k] long: target token ids, most likely first
    probs: Tensor  # [..., k] fp32
    rest: Tensor  # [...] fp32: 1 − Σ probs

    def to(self, device) -> Teacher:
        return Teacher(self.ids.to(device), self.probs.to(device), self.rest.to(device))

    def __getitem__(self, index) -> Teacher:
        return Teacher(self.ids[index], self.probs[index], self.rest[index])


@torch.no_grad()
def sparse_teacher(last_hidden: Tensor, lm_head_weight: Tensor, k: int, chunk: int = 256) -> Teacher:
    """Top-k of softmax(lm_head(last_hidden)) row by row ([n, H] -> Teacher of [n, k]), in chunks of rows."""
    n = last_hidden.shape[0]
    ids = torch.zeros(n, k, dtype=torch.long, device=last_hidden.device)
    probs = torch.zeros(n, k, dtype=torch.float32, device=last_hidden.device)
    for s in range(0, n, chunk):
        logits = F.linear(last_hidden[s:s + chunk].to(lm_head_weight.dtype), lm_head_weight).float()
        top = logits.topk(k, dim=-1)
        probs[s:s + chunk] = (top.values - torch.logsumexp(logits, -1, keepdim=True)).exp()
        ids[s:s + chunk] = top.indices
    return Teacher(ids, probs, (1 - probs.sum(-1)).clamp(min=0))


@dataclass
class Batch:
    """One micro-batch as the trainer sees it (right-padded)."""

    input_ids: Tensor  # [B, S] long
    loss_mask: Tensor  # [B, S] bool: token is a supervised (assistant) token
    lengths: Tensor  # [B] long: unpadded lengths
    sample_ids: Tensor  # [B] long: stable ids (anchor seeds, de-duplication, resume)
    aux_hidden: Tensor  # [B, S, K·H] target capture
    last_hidden: Tensor | None  # [B, S, H] target post-final-norm hidden (None when `teacher` replaces it)
    teacher: Teacher | None = None  # [B, S, k] sparse target distribution (objective.teacher_topk > 0)

    def to(self, device) -> Batch:
        """The batch on `device` (sample ids stay on the host: they key seeds and ledgers)."""
        move = lambda t: None if t is None else t.to(device)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device), self.sample_ids,
                     self.aux_hidden.to(device), move(self.last_hidden), move(self.teacher))


@dataclass
class ObjectiveOutput:
    numerator: Tensor  # differentiable: 0.1·ΣwCE + 0.9·ΣwL1 + 1.0·ΣwBCE (not yet divided by Σw)
    weight_sum: Tensor  # Σw of this micro-batch (fp32 scalar, no grad)
    stats: Tensor  # [len(STAT_NAMES), γ] fp32 sums over slots, for `summarise`


# ---- anchors -----------------------------------------------------------------------------------------------
def anchor_seed(seed: int, step: int, sample_id: int) -> int:
    """Seed of one sequence's anchors at one optimizer step.

    Keyed by the sample id (unique across ranks, so every rank draws different anchors) and the step (so a sample seen
    again in a later epoch gets new anchors). Not keyed by the rank index: a sample then gets the same anchors however
    samples are spread over ranks, which is what makes a 2-rank run equal a 1-rank run and a resumed run equal an
    uninterrupted one.
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_anchors(
    loss_mask: Tensor, lengths: Tensor, num_anchors: int, seeds: list[int]
) -> tuple[Tensor, Tensor]:
    """Up to num_anchors anchors per row, uniform without replacement among valid positions, sorted.

    loss_mask [B, S] bool, lengths [B]. Returns (anchors [B, N] long, valid [B, N] bool); padded slots point at 0.
    A row's draw depends only on its own tokens and seed, never on the batch it was padded into.
    """
    B, S = loss_mask.shape
    if len(seeds) != B:
        raise ValueError(f"need one anchor seed per row: {len(seeds)} seeds for {B} rows")
    ok = loss_mask[:, :-1] & loss_mask[:, 1:]  # p valid iff p and p+1 supervised
    ok &= torch.arange(S - 1, device=ok.device)[None] < (lengths[:, None] - 1)
    keys = torch.full((B, S - 1), 2.0)
    for b, seed in enumerate(seeds):
        n = max(int(lengths[b]) - 1, 0)
        keys[b, :n] = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    keys = keys.to(ok.device).masked_fill(~ok, 2.0)
    N = max(1, min(num_anchors, int(ok.sum(1).max())))
    picked = keys.topk(N, dim=1, largest=False).indices.sort(dim=1).values
    valid = ok.gather(1, picked)
    return picked.masked_fill(~valid, 0), valid


def position_weights(gamma: int, gamma_decay: float, device=None) -> Tensor:
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / gamma_decay)


def block_targets(batch: Batch, anchors: Tensor, valid: Tensor, gamma: int) -> tuple[Tensor, Tensor, Tensor]:
    """(labels, prev, slot_mask), each [B, N, γ]: label x_{a+k+1}, teacher-forced prev x_{a+k}, prefix mask."""
    S = batch.input_ids.shape[1]
    k = torch.arange(gamma, device=anchors.device)
    label_pos = anchors[..., None] + k + 1
    in_range = label_pos < batch.lengths[:, None, None]
    label_pos = label_pos.clamp(max=S - 1)
    flat = lambda t: t.flatten(1)
    supervised = batch.loss_mask.gather(1, flat(label_pos)).view_as(label_pos) & in_range
    slot_mask = supervised.long().cumprod(-1).bool() & valid[..., None]
    labels = batch.input_ids.gather(1, flat(label_pos)).view_as(label_pos)
    prev = batch.input_ids.gather(1, flat(label_pos - 1)).view_as(label_pos)
    return labels, prev, slot_mask


# ---- the full-vocabulary part ------------------------------------------------------------------------------
def _exact_teacher(tgt: Tensor, lm: Tensor, lm_full: Tensor | None, vocab: Tensor | None):
    """(q [c, K], top None, outside [c], rest [c], argmax [c]) from the target's head on post-norm hidden rows."""
    full = F.linear(tgt.to((lm if vocab is None else lm_full).dtype), lm if vocab is None else lm_full).float()
    argmax = full.argmax(-1)
    if vocab is None:
        q = full.sub_(full.amax(-1, keepdim=True)).exp_()
        q = q.div_(q.sum(-1, keepdim=True))
        outside = q.new_zeros(q.shape[0])
    else:  # restricted to S; the target's mass outside S is never accepted
        q = full[:, vocab].sub_(torch.logsumexp(full, -1)[:, None]).exp_()
        outside = (1 - q.sum(-1)).clamp_(min=0)
    return q, None, outside, outside.new_zeros(q.shape[0]), argmax


def _sparse_teacher(t: Teacher, index: Tensor | None, K: int):
    """The same five from a sparse teacher: q scattered onto the K draft columns, `top` marks its tokens there."""
    col = t.ids if index is None else index[t.ids]  # draft column of each top-k token (−1: outside S)
    inset = col >= 0
    col = col.masked_fill(~inset, K)  # a spare column K takes the tokens outside S, then is cut off
    q = t.probs.new_zeros(t.probs.shape[0], K + 1).scatter_(1, col, t.probs)[:, :K]
    top = torch.zeros(q.shape[0], K + 1, dtype=torch.bool, device=q.device).scatter_(1, col, True)[:, :K]
    outside = (t.probs * ~inset).sum(-1)
    return q.contiguous(), top.contiguous(), outside, t.rest, t.ids[:, 0]


class VocabLoss(torch.autograd.Function):
    """ce_w·Σ w·CE + l1_w·Σ w·L1 over rows, with gradients computed chunk by chunk in forward.

    Inputs: h [R, H], latent [R, r], w2 [V, r] (trainable Markov W2), lm [V, H] (frozen), the teacher, labels [R],
    w [R]. Outputs: the differentiable scalar and detached per-row (ce, l1, correct, agree). Logits match
    `DSparkDraft.base_logits(h) + markov_head.bias(latent)`: each matmul in its weight's dtype, summed in fp32.

    The teacher is either `tgt` [R, H], the target's post-norm hidden (the exact distribution is computed here), or
    `teacher`, a sparse `Teacher` of [R, k] (then tgt is None). The sparse one scores L1 over the partition {each
    top-k token} ∪ {the rest, lumped}: |P_rest − rest| stands for Σ over the unlisted tokens, P_rest being the
    draft's mass on them.

    Reduced draft vocabulary S (K tokens): w2 and lm have K rows, `lm_full` [V, H] is the target's head, `vocab` [K]
    the target ids of S and `label_idx` [R] each label's draft id (−1 outside S). The target distribution p stays
    the full-vocabulary one (its logsumexp once per row); the draft's q is zero outside S, so
        L1 = Σ_{v∈S} |q_v − p_v| + (1 − Σ_{v∈S} p_v)   (= 2·TV, the confidence label is 1 − L1/2 = P(accept)),
    CE counts only labels inside S (a label outside S can never be proposed, so it has no gradient to give).
    The out-of-set term does not depend on the draft: the gradient keeps the full-vocabulary form over K columns.
    """

    @staticmethod
    def forward(ctx, h, latent, w2, lm, tgt, labels, w, ce_w: float, l1_w: float, chunk: int,
                lm_full=None, vocab=None, label_idx=None, teacher: Teacher | None = None):
        R, K = h.shape[0], lm.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_h = torch.zeros_like(h) if need_grad else None
        grad_lat = torch.zeros_like(latent) if need_grad else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        ce_rows, l1_rows = h.new_zeros(R, dtype=torch.float32), h.new_zeros(R, dtype=torch.float32)
        correct, agree = h.new_zeros(R, dtype=torch.bool), h.new_zeros(R, dtype=torch.bool)
        index = None
        if vocab is not None and teacher is not None:  # target id -> draft column (−1 outside S)
            index = torch.full((lm_full.shape[0],), -1, dtype=torch.long, device=vocab.device)
            index[vocab] = torch.arange(K, device=vocab.device)
        for s in range(0, R, chunk):
            e = min(s + chunk, R)
            hc, lc, y = h[s:e], latent[s:e], labels[s:e]
            if vocab is not None:  # labels as draft ids; a label outside S gets no CE
                inset = label_idx[s:e] >= 0
                y = label_idx[s:e].clamp(min=0)
            # The serving rollout's Markov step (base + W2·latent, argmax): one definition, and the fused Triton
            # kernel on CUDA (not yet timed there at a chunk's row count). After it, in place wherever possible:
            # these [rows, V] fp32 passes, not the matmuls, dominate on CPU.
            pred, logits = markov_step(F.linear(hc.to(lm.dtype), lm).float(), lc, w2)
            lse = torch.logsumexp(logits, -1)
            ce = lse - logits.gather(1, y[:, None]).squeeze(1)
            p = logits.sub_(lse[:, None]).exp_()  # draft probabilities, in the logits' buffer
            if teacher is None:
                q, top, outside, rest, t_arg = _exact_teacher(tgt[s:e], lm, lm_full, vocab)
            else:
                q, top, outside, rest, t_arg = _sparse_teacher(teacher[s:e], index, K)
            agree[s:e] = (pred if vocab is None else vocab[pred]) == t_arg
            if vocab is not None:
                ce, pred = ce * inset, pred.masked_fill(~inset, -1)
            d = q.sub_(p)  # q − p, in q's buffer
            if top is None:
                l1 = torch.linalg.vector_norm(d, 1, dim=-1) + outside
            else:
                p_rest = (p * ~top).sum(-1)
                l1 = (d.abs() * top).sum(-1) + outside + (p_rest - rest).abs()
            ce_rows[s:e], l1_rows[s:e], correct[s:e] = ce, l1, pred == y
            wc = w[s:e].float()
            total += (wc * (ce_w * ce + l1_w * l1)).sum()
            if not need_grad:
                continue
            # d CE/d z = p − onehot(y);  d L1/d z_j = p_j (s_j − Σ_v s_v p_v) with s = sign(p − q) (the lumped
            # tokens of a sparse teacher all share s = sign(P_rest − rest)).
            sgn = d.sign_().neg_()
            if top is not None:
                sgn = torch.where(top, sgn, (p_rest - rest).sign()[:, None])
            g = sgn.mul_(p)  # s·p
            if vocab is None:
                g.addcmul_(p, g.sum(-1, keepdim=True), value=-1).mul_(l1_w).add_(p, alpha=ce_w)
                g[torch.arange(e - s, device=g.device), y] -= ce_w
            else:
                g.addcmul_(p, g.sum(-1, keepdim=True), value=-1).mul_(l1_w).add_(p * inset[:, None], alpha=ce_w)
                g[torch.arange(e - s, device=g.device)[inset], y[inset]] -= ce_w
            g.mul_(wc[:, None])
            del p
            grad_h[s:e] = (g.to(lm.dtype) @ lm).to(h.dtype)
            grad_lat[s:e] = (g.to(w2.dtype) @ w2).to(latent.dtype)
            grad_w2.addmm_(g.t(), lc.float())
        if need_grad:
            ctx.save_for_backward(grad_h, grad_lat, grad_w2.to(w2.dtype))
        ctx.mark_non_differentiable(ce_rows, l1_rows, correct, agree)
        return total, ce_rows, l1_rows, correct, agree

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_h, grad_lat, grad_w2 = ctx.saved_tensors
        g = grad_total.to(torch.float32)
        return (grad_h * g.to(grad_h.dtype), grad_lat * g.to(grad_lat.dtype), grad_w2 * g.to(grad_w2.dtype),
                None, None, None, None, None, None, None, None, None, None, None)


def teacher_argmax(teacher: Teacher | None, tgt: Tensor | None, lm_full: Tensor, chunk: int) -> Tensor:
    """The target's most likely next token per row (full-vocabulary ids): CE's label under `ce_target: teacher`."""
    if teacher is not None:
        return teacher.ids[:, 0]
    with torch.no_grad():
        return torch.cat([F.linear(tgt[s:s + chunk].to(lm_full.dtype), lm_full).argmax(-1)
                          for s in range(0, tgt.shape[0], chunk)])


# ---- the objective -----------------------------------------------------------------------------------------
def compute_objective(
    draft: DSparkDraft, batch: Batch, anchors: Tensor, valid: Tensor, cfg: ObjectiveConfig
) -> ObjectiveOutput:
    """One micro-batch: one draft forward over all blocks, then the three loss terms over supervised slots."""
    c = draft.config
    gamma = c.block_size
    labels, prev, slot_mask = block_targets(batch, anchors, valid, gamma)
    h = draft.forward_train(batch.input_ids, batch.aux_hidden, anchors)  # [B, N, γ, H]
    latent = draft.markov_head.teacher_forced_latent(prev, h)  # [B, N, γ, r]
    tgt_pos = (anchors[..., None] + torch.arange(gamma, device=anchors.device)).clamp(max=batch.input_ids.shape[1] - 1)
    b_idx, n_idx, k_idx = slot_mask.nonzero(as_tuple=True)
    rows_h, rows_lat = h[b_idx, n_idx, k_idx], latent[b_idx, n_idx, k_idx]
    rows_pos = tgt_pos[b_idx, n_idx, k_idx]
    rows_tgt, teacher = None, None
    if batch.teacher is not None:
        teacher = batch.teacher[b_idx, rows_pos]
    else:
        rows_tgt = batch.last_hidden[b_idx, rows_pos]
    w = position_weights(gamma, cfg.gamma_decay, h.device)[k_idx]
    rows_labels, reduced = labels[b_idx, n_idx, k_idx], (None, None, None)
    if cfg.ce_target == "teacher":
        rows_labels = teacher_argmax(teacher, rows_tgt, draft.target.lm_head.weight, cfg.vocab_chunk_rows)
    if c.reduced_vocab:  # the K hot lm_head rows score the draft; the full head gives the target's distribution
        vocab = draft.vocab
        index = torch.full((c.vocab_size,), -1, dtype=torch.long, device=vocab.device)
        index[vocab] = torch.arange(vocab.shape[0], device=vocab.device)
        reduced = (draft.target.lm_head.weight, vocab, index[rows_labels])
    numerator, ce, l1, correct, agree = VocabLoss.apply(
        rows_h, rows_lat, draft.markov_head.markov_w2.weight, draft.head_weight(), rows_tgt,
        rows_labels, w, cfg.ce_weight, cfg.l1_weight, cfg.vocab_chunk_rows, *reduced, teacher,
    )
    alpha = (1 - l1 / 2).clamp(0, 1)  # detached: VocabLoss marks l1 non-differentiable
    bce = torch.zeros_like(alpha)
    conf_err = torch.zeros_like(alpha)
    if draft.confidence_head is not None:
        prev_rows = prev[b_idx, n_idx, k_idx]
        conf_h = rows_h.detach() if cfg.confidence_detach else rows_h
        conf = draft.confidence_head(conf_h, draft.markov_head.markov_w1(prev_rows).to(rows_h.dtype))
        bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
        numerator = numerator + cfg.bce_weight * (w * bce).sum()
        conf_err = (torch.sigmoid(conf.detach()) - alpha).abs()
    stats = _slot_stats(gamma, b_idx, n_idx, k_idx, w, ce, l1, bce.detach(), correct, agree, conf_err, alpha,
                        anchors.shape)
    return ObjectiveOutput(numerator=numerator, weight_sum=w.sum(), stats=stats)


def _slot_stats(gamma, b_idx, n_idx, k_idx, w, ce, l1, bce, correct, agree, conf_err, alpha, anchor_shape) -> Tensor:
    """Sums per position k of each STAT_NAMES entry; alpha_prefix sums Π_{j≤k} α_j over blocks (prefix mask holds)."""
    dev = w.device
    prefix = torch.ones(*anchor_shape, gamma, device=dev)
    prefix[b_idx, n_idx, k_idx] = alpha
    prefix = prefix.cumprod(-1)[b_idx, n_idx, k_idx]
    cols = [torch.ones_like(w), w, ce, l1, bce, correct.float(), agree.float(), conf_err, prefix]
    out = torch.zeros(len(cols), gamma, device=dev)
    for i, col in enumerate(cols):
        out[i].index_add_(0, k_idx, col.float())
    return out


# ---- after the last micro-batch ----------------------------------------------------------------------------
def normalise_gradients(params, weight_sum: Tensor, scale: float = 1.0) -> float:
    """Divide accumulated gradients of the numerators by the global Σw (already all-reduced by the caller).

    `scale` undoes a data-parallel gradient average (pass the world size when the wrapper averages over ranks).
    Returns the divisor used.
    """
    total = float(weight_sum)
    if total <= 0:
        raise ValueError("no supervised slot in this optimizer step (Σw = 0): every sample has an empty loss mask")
    factor = scale / total
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)
    return total


def summarise(stats: Tensor) -> dict[str, float]:
    """Global stats [len(STAT_NAMES), γ] -> logged metrics (loss terms weighted; per-position acc/CE; τ_prob)."""
    s = dict(zip(STAT_NAMES, stats.double(), strict=True))
    count, weight = s["count"], s["weight"]
    n = count.clamp(min=1)
    w_k = weight / n  # the position weight itself (count·w_k / count)
    out = {
        "ce": float((s["ce"] * w_k).sum() / weight.sum().clamp(min=1e-12)),
        "l1": float((s["l1"] * w_k).sum() / weight.sum().clamp(min=1e-12)),
        "bce": float((s["bce"] * w_k).sum() / weight.sum().clamp(min=1e-12)),
        "acc": float(s["correct"].sum() / count.sum().clamp(min=1)),
        "teacher_agreement": float(s["agree"].sum() / count.sum().clamp(min=1)),
        "conf_abs_err": float(s["conf_abs_err"].sum() / count.sum().clamp(min=1)),
        "tau_prob": 1.0 + float((s["alpha_prefix"] / n).sum()),
        "slots": float(count.sum()),
    }
    for k in range(stats.shape[1]):
        out[f"acc_{k}"] = float(s["correct"][k] / n[k])
        out[f"ce_{k}"] = float(s["ce"][k] / n[k]) if count[k] > 0 else math.nan
    return out
