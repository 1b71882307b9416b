"""The sequential Markov rollout over one parallel draft block (serving and drift analysis share it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_sgl.kernels.markov_step import markov_step
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.speculative.sampling import ROLLOUT, Noise, as_noise, sample_u


@dataclass
class Proposal:
    tokens: Tensor  # [B, γ] draft tokens x_1..x_γ
    logits: Tensor  # [B, γ, V] fp32 step logits ℓ_t = base_t + Markov bias(prev_t)
    conf_logits: Tensor | None  # [B, γ] raw confidence logits (σ(z / T_sts) = P(token t survives | prefix))


@torch.no_grad()
def rollout(
    draft: DSparkDraft,
    h: Tensor,
    anchor: Tensor,
    temperature: float | Tensor = 0.0,
    generator: torch.Generator | Noise | None = None,
) -> Proposal:
    """h [B, γ, H] final draft hidden of the block, anchor [B] -> γ tokens chosen left to right.

    Step t adds the Markov bias of the previous token (the anchor for t = 0) to the parallel base logits, then picks
    x_t greedily (T = 0) or samples it from softmax(ℓ_t / T). temperature may be one per row ([B], 0 = greedy row).
    """
    if isinstance(temperature, Tensor):
        temps = temperature.to(h.device, torch.float32)
        any_sampled = bool((temps > 0).any())
    else:
        temps = torch.full((h.shape[0],), float(temperature), device=h.device)
        any_sampled = temperature > 0
    sampled = temps > 0
    u = as_noise(generator).uniform(h.shape[0], h.shape[1], ROLLOUT, h.device) if any_sampled else None
    head, conf_head = draft.markov_head, draft.confidence_head
    base = draft.base_logits(h)
    prev, state = anchor, None
    tokens, logits, confs = [], [], []
    for t in range(h.shape[1]):
        latent, state = head.latent(prev, h[:, t], state)
        if conf_head is not None:
            confs.append(conf_head(h[:, t], head.markov_w1(prev).to(h.dtype)))
        prev, step = markov_step(base[:, t], latent, head.markov_w2.weight)  # fused bias + argmax on GPU
        if any_sampled:
            probs = torch.softmax(step.float() / torch.where(sampled, temps, 1.0)[:, None], -1)
            prev = torch.where(sampled, sample_u(probs, u[:, t]), prev)
        tokens.append(prev)
        logits.append(step)
    conf = torch.stack(confs, 1) if confs else None
    return Proposal(torch.stack(tokens, 1), torch.stack(logits, 1), conf)
