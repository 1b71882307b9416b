"""Draft context K/V kept beside SGLang's target KV cache, indexed by the same slot ids.

Every committed token (prompt tokens, each step's anchor and accepted drafts) gets its context K/V written at the
slot where the target wrote its own KV. SGLang's allocator, radix cache, retraction and chunked prefill therefore
manage the draft context for free: a slot that holds a token's target KV holds its draft context too, and a slot
that is freed and reused is overwritten by the next write to it.

Each slot also records the draft epoch that wrote it. A live draft update (weights.py) starts a new epoch: context
written by the old weights is then stale, and `gather` reports which requests still read some (they verify the
anchor alone, i.e. plain decoding, until they finish; a radix-cached prefix stays stale until SGLang flushes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_sgl.model.draft import DSparkDraft


@dataclass
class GatheredContext:
    """One decode step's view of the pool, in the shape `DSparkDraft.forward_step` reads (as DraftContextCache)."""

    lengths: Tensor  # [B] committed tokens with context K/V
    k: list[Tensor]  # per layer [B, kv_heads, S, d] (MLA: [B, 1, S, kv_lora_rank] latent, v = [B, 1, S, rope])
    v: list[Tensor]
    stale: Tensor | None = None  # [B] bool: some context was written by an earlier draft epoch
    last: Tensor | None = None  # [B, H] anchor_state: the context vector of each request's last committed token

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def kv(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.k, self.v, strict=True))


class DraftContextPool:
    def __init__(self, draft: DSparkDraft, num_slots: int, device: torch.device | str, dtype: torch.dtype):
        c = draft.config
        self.draft = draft
        # GQA: K/V heads; MLA: the latent (kv_a_layernorm(c_kv), RoPE(k_pe)) = the target's own page layout, kept
        # in this separate pool (sharing the target's MLA pages would need the draft layers registered in them).
        (nk, dk), (nv, dv) = draft.context_kv_dims()
        self.k = torch.zeros(c.num_hidden_layers, num_slots, nk, dk, device=device, dtype=dtype)
        self.v = torch.zeros(c.num_hidden_layers, num_slots, nv, dv, device=device, dtype=dtype)
        self.epoch = 0
        self.slot_epoch = torch.zeros(num_slots, device=device, dtype=torch.int32)
        # anchor_state: each slot's projected context vector too (the block rows read the one before the anchor)
        self.ctx = torch.zeros(num_slots, c.hidden_size, device=device, dtype=dtype) if c.anchor_state else None

    def new_epoch(self, draft: DSparkDraft) -> None:
        """A new draft serves from now on: everything written so far is stale context."""
        self.draft = draft
        self.epoch += 1

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @torch.no_grad()
    def write(self, slots: Tensor, aux_hidden: Tensor, positions: Tensor, keep: Tensor | None = None) -> None:
        """Context K/V of tokens with target aux hidden [N, K·H] at absolute positions [N] into slots [N]. With
        keep [N] bool, only kept tokens are written: the others go to SGLang's padding slot 0 (never a token's slot),
        so the write has a fixed shape and no boolean-mask indexing (which hides a device->host sync)."""
        if slots.numel() == 0:
            return
        if keep is not None:
            slots = torch.where(keep, slots, 0)
        ctx = self.draft.project_context(aux_hidden)[None]  # [1, N, H]
        slots = slots.long()
        for layer, (k, v) in enumerate(self.draft.context_kv(ctx, positions.long()[None])):
            self.k[layer, slots] = k[0].transpose(0, 1).to(self.k.dtype)  # [N, kv_heads, d]
            self.v[layer, slots] = v[0].transpose(0, 1).to(self.v.dtype)
        self.slot_epoch[slots] = self.epoch
        if self.ctx is not None:
            self.ctx[slots] = ctx[0].to(self.ctx.dtype)

    def gather(self, req_to_token: Tensor, req_pool_indices: Tensor, lengths: Tensor,
               width: int | None = None) -> GatheredContext:
        """Context of each request's first lengths[b] tokens, right-padded to `width` (padding is masked). Pass
        width = the longest length from host-side state (SGLang's seq_lens_cpu): reading it off `lengths` is a
        device->host sync."""
        width = max(int(lengths.max()) if width is None else width, 1)
        slots = req_to_token[req_pool_indices.long(), :width].long().clamp(0, self.num_slots - 1)  # [B, S]
        k = [self.k[layer][slots].transpose(1, 2) for layer in range(self.k.shape[0])]
        v = [self.v[layer][slots].transpose(1, 2) for layer in range(self.v.shape[0])]
        stale = None
        if self.epoch:
            written = torch.arange(width, device=slots.device)[None] < lengths.long()[:, None]
            stale = ((self.slot_epoch[slots] != self.epoch) & written).any(1)
        last = None
        if self.ctx is not None:  # the slot of token lengths-1 (none before the first: zeros)
            before = (lengths.long() - 1).clamp(0, width - 1)[:, None]
            last = self.ctx[slots.gather(1, before)[:, 0]] * (lengths > 0)[:, None].to(self.ctx.dtype)
        return GatheredContext(lengths.long(), k, v, stale, last)
