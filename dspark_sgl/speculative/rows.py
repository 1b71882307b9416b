"""One decode step's sampling for a batch whose rows each carry their own parameters (greedy and sampled rows,
different temperatures, top-k/top-p/min-p, penalties, logit bias, seeds), as whole-batch tensor ops.

Called by the reference engine and the SGLang worker alike; they supply logits and bookkeeping, nothing else:
    propose     - the draft's Markov rollout, greedy or sampled per row
    next_tokens - one token from the target's own distribution (plain decoding: the reference's sampler)
    accept_rows - verify: greedy rows by argmax match, sampled rows by the rejection or block rule, in one pass
                  (with one-hot p and q those rules ARE the greedy rule, so a mixed batch needs no split)
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_sgl.faults import planted
from dspark_sgl.kernels.accept import block_accept_dispatch, greedy_accept_dispatch, rejection_accept_dispatch
from dspark_sgl.kernels.accept_reference import Acceptance
from dspark_sgl.kernels.noise import BONUS, Noise, sample, sample_u
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.speculative.markov import Proposal, rollout
from dspark_sgl.speculative.target_dist import (
    BatchSampling,
    OutputHistory,
    draft_dist,
    probs_from_logits,
    target_dist,
)
from dspark_sgl.speculative.timing import StepTimer

# The acceptance rules as dispatched: the fused Triton kernels on CUDA (dspark_sgl.kernels.accept), the torch
# definitions (dspark_sgl.kernels.accept_reference) everywhere else, so the CPU path runs exactly the definitions.
SAMPLED_RULES = {"rejection": rejection_accept_dispatch, "block": block_accept_dispatch}


def step_noise(s: BatchSampling, generator: torch.Generator | None, positions: Tensor | None) -> Noise:
    """The step's random numbers: seeded rows hash (seed, anchor position), the rest read the generator."""
    if s.seeds is None or planted("seed"):
        return Noise(generator)
    return Noise(generator, s.seeds, s.seeded, positions)


def propose(draft: DSparkDraft, h: Tensor, anchor: Tensor, s: BatchSampling, noise: Noise,
            timer: StepTimer | None = None) -> Proposal:
    temps = 0.0 if s.all_greedy else torch.where(s.greedy, 0.0, s.temperature)
    return rollout(draft, h, anchor, temps, noise, timer, any_sampled=not s.all_greedy)  # a non-greedy row has T > 0


def next_tokens(logits: Tensor, s: BatchSampling, history: OutputHistory | None, noise: Noise) -> Tensor:
    """logits [B, V] -> [B] tokens drawn from the target's distribution (argmax on greedy rows)."""
    return draw(target_dist(logits[:, None], s, history)[:, 0], s, noise)


def plain_tokens(adjusted: Tensor, s: BatchSampling, noise: Noise) -> Tensor:
    """next_tokens for logits [B, V] ALREADY adjusted (adjust_logits: penalties, logit bias), as the SGLang worker's
    off step has them: the same draw (the same BONUS noise stream)."""
    return draw(probs_from_logits(adjusted[:, None], s)[:, 0], s, noise)


def draw(probs: Tensor, s: BatchSampling, noise: Noise) -> Tensor:
    """probs [B, V] -> one token per row: argmax on greedy rows, the BONUS noise stream on sampled ones."""
    if s.all_greedy:
        return probs.argmax(-1)
    u = noise.uniform(probs.shape[0], 1, BONUS, probs.device)[:, 0]
    return torch.where(s.greedy, probs.argmax(-1), sample_u(probs, u))


def accept_rows(prop: Proposal, logits: Tensor, s: BatchSampling, limit: Tensor | None, noise: Noise,
                rule: str = "rejection") -> Acceptance:
    """logits [B, W, V]: the target's logits over [anchor, x_1..x_{W-1}], ALREADY adjusted (target_dist's
    adjust_logits: penalties on history + earlier drafts, logit bias). Request b accepts at most limit[b] drafts."""
    W = logits.shape[1]
    x = prop.tokens[:, : W - 1]
    if s.all_greedy:
        return greedy_accept_dispatch(x, logits, limit)
    p = probs_from_logits(logits, s)
    q = draft_dist(prop.logits[:, : W - 1], x, s, prop.vocab, logits.shape[-1])  # zero outside a K-token vocab
    res = SAMPLED_RULES[rule](x, q, p, limit, noise)
    if planted("match_residual") and prop.from_match is not None:  # a rejected match's bonus ~ p, x kept in it
        c = res.num_accepted
        rejected = prop.from_match & (c < (W - 1 if limit is None else limit.clamp(max=W - 1)))
        row = p.gather(1, c[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
        res.bonus = torch.where(rejected, sample(row, noise), res.bonus)
    return res
