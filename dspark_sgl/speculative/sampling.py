"""Turning logits into distributions and tokens; the same functions serve the target, the draft and the tests.

The random numbers and the inverse-CDF draw they feed are dspark_sgl.kernels.noise (the acceptance kernels and their
references draw through them too).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_sgl.kernels.noise import Noise, sample


def target_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """softmax(logits / T) restricted to the top-p nucleus (SGLang's rule: a token stays while the mass strictly
    before it is <= top_p). T = 0 gives the one-hot argmax (ties to the lowest index). The full per-request
    definition (top-k, min-p, penalties, bias) is dspark_sgl.speculative.target_dist."""
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before > top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_probs(logits: Tensor, temperature: float, vocab: Tensor | None = None, vocab_size: int = 0) -> Tensor:
    """The draft's proposal distribution q = softmax(ℓ / T) (the draft ignores top-p, as SGLang's does).

    A reduced-vocabulary draft's logits cover its K tokens; `vocab` [K] places them at their target ids in a
    [..., vocab_size] q that is zero outside the draft vocabulary, so rejection sampling's residual max(p − q, 0)
    covers every target token.
    """
    q = target_probs(logits, temperature, 1.0)
    if vocab is None:
        return q
    return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, vocab.to(q.device), q)


def next_token(
    logits: Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | Noise | None = None
) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(target_probs(logits, temperature, top_p), generator)
