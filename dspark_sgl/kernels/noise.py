"""The random numbers of one decode step and the inverse-CDF draw, below everything that samples: the acceptance
rules (a fused kernel draws the same numbers in the same order as its torch reference), the Markov rollout and the
target's sampler.

Randomness comes from `Noise`: uniforms from a torch.Generator, or, for a request with its own seed, a counter hash
of (seed, position, stream, index). A seeded request therefore draws the same numbers whatever else is in the batch,
and every draw is by inverse CDF (one uniform per token), so both kinds of row share one code path.
"""

from __future__ import annotations

import torch
from torch import Tensor

# independent random streams of one decode step (the counter hash keeps them apart)
ROLLOUT, ACCEPT, BONUS = 0, 1, 2
_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's finaliser: a bijection on 32-bit ints that mixes every input bit into every output bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hashed_uniform(seed: Tensor, position: Tensor, stream: int, n: int) -> Tensor:
    """[B, n] float64 uniforms in (0, 1), a pure function of (seed[b], position[b], stream, index)."""
    seed, position = seed.long()[:, None], position.long()[:, None]
    idx = torch.arange(n, device=seed.device)[None] + stream * 0x10000
    h = _fmix32((seed & _M32) ^ 0x9E3779B9)
    h = _fmix32(h ^ ((seed >> 32) & _M32))
    h = _fmix32(h ^ (position & _M32))
    h = _fmix32(h ^ idx)
    return (h.double() + 0.5) / 2.0**32


class Noise:
    """Uniform random numbers for one step of a batch of B rows.

    Rows with a seed (seeded[b]) get hashed_uniform(seed, position); the others read the generator. positions are
    each row's anchor position, so a seeded request's numbers depend on nothing but its own seed and progress."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        seeds: Tensor | None = None,
        seeded: Tensor | None = None,
        positions: Tensor | None = None,
    ):
        self.generator, self.seeds, self.seeded, self.positions = generator, seeds, seeded, positions

    def uniform(self, B: int, n: int, stream: int, device) -> Tensor:
        u = torch.rand(B, n, generator=self.generator, device=device, dtype=torch.float64)
        if self.seeds is not None:
            h = hashed_uniform(self.seeds.to(device), self.positions.to(device), stream, n)
            u = torch.where(self.seeded.to(device)[:, None], h, u)
        return u


def as_noise(g: torch.Generator | Noise | None) -> Noise:
    return g if isinstance(g, Noise) else Noise(g)


def sample_u(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: one token per row of probs [..., V] from uniforms u [...] in [0, 1) (probs need not sum
    to 1). A zero-probability token is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1]).double()
    cdf = flat.cumsum(-1)
    x = (u.reshape(-1, 1).double() * cdf[:, -1:]).contiguous()
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    last = torch.where(flat > 0, torch.arange(flat.shape[-1], device=flat.device), 0).amax(-1)
    return idx.minimum(last).view(probs.shape[:-1])


def sample(probs: Tensor, generator: torch.Generator | Noise | None = None, stream: int = BONUS) -> Tensor:
    """One token per row of probs [..., V]."""
    rows = probs.reshape(-1, probs.shape[-1]).shape[0]
    u = as_noise(generator).uniform(rows, 1, stream, probs.device)
    return sample_u(probs, u[:, 0]).view(probs.shape[:-1])
