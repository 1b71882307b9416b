"""The sequential Markov rollout over one parallel draft block (serving and drift analysis share it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_sgl.faults import planted
from dspark_sgl.kernels.markov_step import markov_step
from dspark_sgl.kernels.noise import ROLLOUT, Noise, as_noise, sample_u
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.speculative.sampling import draft_probs
from dspark_sgl.speculative.timing import StepTimer


@dataclass
class Proposal:
    tokens: Tensor  # [B, γ] draft tokens x_1..x_γ (target ids)
    logits: Tensor  # [B, γ, K] fp32 step logits ℓ_t = base_t + Markov bias(prev_t), over the draft vocabulary
    conf_logits: Tensor | None  # [B, γ] raw confidence logits (σ(z / T_sts) = P(token t survives | prefix))
    vocab: Tensor | None = None  # [K] target ids of the draft vocabulary (None: K = V, the identity)
    from_match: Tensor | None = None  # [B] bool: rows whose tokens are a match from the text (one-hot q; match.py)

    def q(self, temperature: float, n: int, vocab_size: int) -> Tensor:
        """q [B, n, V] of the first n drafts over the target vocabulary (zero outside a reduced draft vocabulary)."""
        return draft_probs(self.logits[:, :n], temperature, self.vocab, vocab_size)


@torch.no_grad()
def rollout(
    draft: DSparkDraft,
    h: Tensor,
    anchor: Tensor,
    temperature: float | Tensor = 0.0,
    generator: torch.Generator | Noise | None = None,
    timer: StepTimer | None = None,
    any_sampled: bool | None = None,
) -> Proposal:
    """h [B, γ, H] final draft hidden of the block, anchor [B] -> γ tokens chosen left to right.

    Step t adds the Markov bias of the previous token (the anchor for t = 0) to the parallel base logits, then picks
    x_t greedily (T = 0) or samples it from softmax(ℓ_t / T). temperature may be one per row ([B], 0 = greedy row).
    A reduced-vocabulary draft picks among its K tokens and maps the pick to its target id (the next step's previous
    token is that target id). any_sampled: whether some row of a per-row temperature is > 0, when the caller knows
    it on the host (else it is read off the tensor: a device->host sync).
    """
    if isinstance(temperature, Tensor):
        temps = temperature.to(h.device, torch.float32)
        if any_sampled is None:
            any_sampled = bool((temps > 0).any())
    else:
        temps = torch.full((h.shape[0],), float(temperature), device=h.device)
        any_sampled = temperature > 0
    sampled = temps > 0
    u = as_noise(generator).uniform(h.shape[0], h.shape[1], ROLLOUT, h.device) if any_sampled else None
    head, conf_head, vocab = draft.markov_head, draft.confidence_head, draft.vocab
    if timer is not None:
        timer.start(h)
    base = draft.base_logits(h)
    if timer is not None:
        timer.lap("lm_head", base)
    prev, state = anchor, None
    tokens, logits, confs = [], [], []
    for t in range(h.shape[1]):
        if conf_head is not None:
            confs.append(conf_head(h[:, t], head.markov_w1(prev).to(h.dtype)))
            if timer is not None:
                timer.lap("confidence", confs[-1])
        latent, state = head.latent(anchor if planted("markov_prev") else prev, h[:, t], state)
        prev, step = markov_step(base[:, t], latent, head.markov_w2.weight, vocab=vocab)  # fused bias + argmax
        if any_sampled:
            probs = torch.softmax(step.float() / torch.where(sampled, temps, 1.0)[:, None], -1)
            pick = sample_u(probs, u[:, t])
            if vocab is not None:  # draft id -> target id (d2t)
                pick = vocab[(pick + 1) % vocab.shape[0]] if planted("d2t_sampled") else vocab[pick]
            prev = torch.where(sampled, pick, prev)
        tokens.append(prev)
        logits.append(step)
        if timer is not None:
            timer.lap("markov", prev)
    conf = torch.stack(confs, 1) if confs else None
    return Proposal(torch.stack(tokens, 1), torch.stack(logits, 1), conf, vocab)
