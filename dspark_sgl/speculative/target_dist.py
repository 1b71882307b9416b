"""The distribution the target samples from, per request and per position: one definition for the reference engine
and the SGLang worker, with SGLang 0.5.23's semantics (`SamplingBatchInfo.apply_logits_bias`, then `Sampler`):

    logits + additive penalties      (−frequency·count, −presence·[count > 0], −inf on stop tokens while the output
                                      is shorter than min_new_tokens)
           → repetition penalty      (on tokens seen: x < 0 → x·r, else x / r)
           → + logit bias
           → greedy (T = 0 or top_k = 1): one-hot argmax
           → softmax(· / T), then top-k, top-p and min-p judged jointly on that softmax (the torch Sampler: the
             top-p cut uses the mass before top-k removed anything; min-p compares with the largest probability),
             renormalised. `joint=False` is the FlashInfer order instead (top-k, renormalise, then top-p).

Penalties count the request's OUTPUT tokens only (SGLang never penalises the prompt): the committed ones up to and
including the anchor, plus, at verify position j, the block's draft tokens x_1..x_j. Everything is vectorised over
the batch and the block: logits [B, W, V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_sgl.faults import planted

GREEDY_EPS = 1e-6  # SGLang: 0 <= T < 1e-6 means greedy


@dataclass
class RequestSampling:
    """What one request asks for (SGLang's SamplingParams names; top_k = -1 is the whole vocabulary)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # what min_new_tokens holds back
    sampling_seed: int | None = None  # a per-request random stream (same output whatever the batch)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
                or self.min_new_tokens > 0)

    def validate(self, vocab_size: int) -> None:
        """One ValueError naming the value and its allowed range (SGLang's ranges)."""
        checks = [
            ("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "(0, 1]"),
            ("top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "-1 (all) or >= 1"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "[0, 1]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "[-2, 2]"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "[-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 2, "(0, 2]"),
            ("min_new_tokens", self.min_new_tokens, self.min_new_tokens >= 0, ">= 0"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={value} is out of range; allowed: {allowed}")
        for tok in (self.logit_bias or {}):
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"logit_bias key {tok} is out of range; allowed: [0, {vocab_size - 1}]")


@dataclass
class BatchSampling:
    """RequestSampling of B rows as tensors on one device; host flags say which stages any row needs."""

    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B] float (1 on greedy rows)
    top_k: Tensor  # [B] long (V = off)
    top_p: Tensor  # [B] float
    min_p: Tensor  # [B] float
    frequency: Tensor  # [B] float
    presence: Tensor  # [B] float
    repetition: Tensor  # [B] float
    min_new_tokens: Tensor  # [B] long
    stop_mask: Tensor | None  # [B, V] bool, only when some row has min_new_tokens
    logit_bias: Tensor | None  # [B, V] float
    seeds: Tensor | None  # [B] long, only when some row has a seed
    seeded: Tensor | None  # [B] bool
    all_greedy: bool
    any_penalty: bool
    any_filter: bool  # some sampled row uses top-k, top-p or min-p
    joint: bool = True  # torch Sampler semantics (False: FlashInfer's top-k-then-top-p)

    @classmethod
    def from_requests(cls, reqs: list[RequestSampling], vocab_size: int, device, joint: bool = True) -> BatchSampling:
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        V = vocab_size
        greedy = [r.greedy for r in reqs]
        stop_mask = bias = seeds = seeded = None
        if any(r.min_new_tokens > 0 for r in reqs):
            stop_mask = torch.zeros(len(reqs), V, dtype=torch.bool)
            for b, r in enumerate(reqs):
                stop_mask[b, [i for i in r.stop_token_ids if 0 <= i < V]] = True
            stop_mask = stop_mask.to(device)
        if any(r.logit_bias for r in reqs):
            bias = torch.zeros(len(reqs), V)
            for b, r in enumerate(reqs):
                for tok, val in (r.logit_bias or {}).items():
                    bias[b, int(tok)] = float(val)
            bias = bias.to(device)
        if any(r.sampling_seed is not None for r in reqs):
            seeds = t([r.sampling_seed or 0 for r in reqs], torch.long)
            seeded = t([r.sampling_seed is not None for r in reqs], torch.bool)
        sampled = [r for r in reqs if not r.greedy]
        return cls(
            greedy=t(greedy, torch.bool),
            temperature=t([1.0 if g else r.temperature for g, r in zip(greedy, reqs, strict=True)], torch.float32),
            top_k=t([V if r.top_k < 1 else min(r.top_k, V) for r in reqs], torch.long),
            top_p=t([r.top_p for r in reqs], torch.float32),
            min_p=t([r.min_p for r in reqs], torch.float32),
            frequency=t([r.frequency_penalty for r in reqs], torch.float32),
            presence=t([r.presence_penalty for r in reqs], torch.float32),
            repetition=t([r.repetition_penalty for r in reqs], torch.float32),
            min_new_tokens=t([r.min_new_tokens for r in reqs], torch.long),
            stop_mask=stop_mask,
            logit_bias=bias,
            seeds=seeds,
            seeded=seeded,
            all_greedy=all(greedy),
            any_penalty=any(r.penalised for r in reqs),
            any_filter=any((0 < r.top_k < V) or r.top_p < 1 or r.min_p > 0 for r in sampled),
            joint=joint,
        )

    def select(self, rows: Tensor) -> BatchSampling:
        """The same rows' sampling after rows left the batch (host flags stay conservative)."""
        pick = {k: (getattr(self, k)[rows] if isinstance(getattr(self, k), Tensor) else getattr(self, k))
                for k in self.__dataclass_fields__}
        pick["all_greedy"] = bool(pick["greedy"].all())
        return replace(self, **pick)


@dataclass
class OutputHistory:
    """A request's output so far, up to and including the anchor: token counts [B, V] and length [B]."""

    counts: Tensor
    length: Tensor

    @classmethod
    def from_tokens(cls, tokens: Tensor, valid: Tensor, vocab_size: int) -> OutputHistory:
        """tokens [B, L] with valid [B, L] marking real output tokens (padding anywhere else)."""
        counts = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
        counts.scatter_add_(1, tokens.long().clamp(0, vocab_size - 1), valid.float())
        return cls(counts, valid.long().sum(-1))

    @classmethod
    def from_lists(cls, outputs: list[list[int]], vocab_size: int, device) -> OutputHistory:
        L = max((len(o) for o in outputs), default=0)
        tokens = torch.zeros(len(outputs), max(L, 1), dtype=torch.long)
        valid = torch.zeros_like(tokens, dtype=torch.bool)
        for b, o in enumerate(outputs):
            tokens[b, : len(o)] = torch.tensor(o, dtype=torch.long)
            valid[b, : len(o)] = True
        return cls.from_tokens(tokens.to(device), valid.to(device), vocab_size)


def adjust_logits(logits: Tensor, s: BatchSampling, history: OutputHistory | None, drafts: Tensor | None) -> Tensor:
    """Penalties and logit bias on logits [B, W, V] (fp32 copy). Column j sees the history plus drafts[:, :j]."""
    x = logits.float().clone()
    B, W, V = x.shape
    if s.any_penalty:
        if history is None:
            raise ValueError("penalised requests need their output history")
        counts = history.counts[:, None].expand(B, W, V).clone()
        if W > 1 and not planted("penalty_drafts"):
            counts[:, 1:] += F.one_hot(drafts[:, : W - 1].long(), V).float().cumsum(1)
        add = -s.frequency[:, None, None] * counts - s.presence[:, None, None] * (counts > 0).float()
        if s.stop_mask is not None:
            n_out = history.length[:, None] + torch.arange(W, device=x.device)[None]  # output length at column j
            held = (n_out < s.min_new_tokens[:, None])[..., None] & s.stop_mask[:, None]
            add = add.masked_fill(held, float("-inf"))
        x = x + add
        scale = torch.where(counts > 0, s.repetition[:, None, None], torch.ones_like(x))
        x = torch.where(x < 0, x * scale, x / scale)
    if s.logit_bias is not None:
        x = x + s.logit_bias[:, None]
    return x


def _filter(probs: Tensor, s: BatchSampling) -> Tensor:
    """top-k, top-p, min-p on probs [B, W, V] in sorted order, renormalised, back in vocabulary order."""
    sp, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sp.cumsum(-1) - sp  # mass strictly before each token, on the unfiltered softmax (joint)
    if planted("top_p_boundary"):  # the mass up to and including the token: the boundary token goes too
        before = torch.where(torch.arange(sp.shape[-1], device=sp.device) == 0, 0.0, before + sp)
    sp = sp * (torch.arange(sp.shape[-1], device=sp.device) < s.top_k[:, None, None])
    if not s.joint:  # FlashInfer with min-p: top-p judged on the renormalised top-k
        sp = sp / sp.sum(-1, keepdim=True)
        before = sp.cumsum(-1) - sp
    sp = sp.masked_fill(before > s.top_p[:, None, None], 0.0)  # the first token always stays
    sp = sp.masked_fill(sp < sp[..., :1] * s.min_p[:, None, None], 0.0)
    sp = sp / sp.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sp)


def probs_from_logits(x: Tensor, s: BatchSampling) -> Tensor:
    """The distribution [B, W, V] from adjusted logits: one-hot argmax on greedy rows, filtered softmax(x/T) else."""
    onehot = F.one_hot(x.argmax(-1), x.shape[-1]).float()
    if s.all_greedy:
        return onehot
    probs = torch.softmax(x / s.temperature[:, None, None], -1)
    if s.any_filter:
        probs = _filter(probs, s)
    return torch.where(s.greedy[:, None, None], onehot, probs)


def target_dist(logits: Tensor, s: BatchSampling, history: OutputHistory | None = None,
                drafts: Tensor | None = None) -> Tensor:
    """logits [B, W, V] of [anchor, x_1..x_{W-1}] -> the distribution the target samples from at each column."""
    return probs_from_logits(adjust_logits(logits, s, history, drafts), s)


def draft_dist(logits: Tensor, tokens: Tensor, s: BatchSampling, vocab: Tensor | None = None,
               vocab_size: int | None = None) -> Tensor:
    """The draft's proposal q [B, γ, V]: softmax(ℓ / T) on sampled rows, a point mass on the greedy rollout's token
    on greedy rows (so one acceptance rule serves both: with one-hot p and q it is exactly the greedy rule).
    A reduced-vocabulary draft's logits cover its K tokens (`vocab` [K] their target ids): q is zero elsewhere."""
    V = logits.shape[-1] if vocab is None else vocab_size
    onehot = F.one_hot(tokens.long(), V).float()
    if s.all_greedy:
        return onehot
    q = torch.softmax(logits.float() / s.temperature[:, None, None], -1)
    if vocab is not None:
        q = q.new_zeros(*q.shape[:-1], V).index_copy_(-1, vocab.to(q.device), q)
    return torch.where(s.greedy[:, None, None], onehot, q)
