"""Turning logits into distributions and tokens; the same functions serve the target, the draft and the tests."""

from __future__ import annotations

import torch
from torch import Tensor


def target_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """The distribution the target samples from: softmax(logits / T) restricted to the top-p nucleus.

    T = 0 gives the one-hot argmax (ties to the lowest index), so greedy and sampled paths share one code path.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_probs(logits: Tensor, temperature: float) -> Tensor:
    """The draft's proposal distribution q = softmax(ℓ / T) (the draft ignores top-p, as SGLang's does)."""
    return target_probs(logits, temperature, 1.0)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(
    logits: Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(target_probs(logits, temperature, top_p), generator)
