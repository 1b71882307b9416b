"""Embedded target adapter over transformers causal LMs.

Convention (the same everywhere in this project, SGLang capture included): aux layer id i is the OUTPUT of
decoder layer i (HF `hidden_states[i + 1]`), i.e. the residual stream before layer i+1's input norm. We read it
with forward hooks on the decoder layers, so no full `output_hidden_states` stack is materialised.

`TargetKV` keeps a batch of ragged requests in one preallocated cache that every forward writes in place at per-row
columns; after a verify pass each request keeps a different number of the new positions, and `commit` only moves
each row's end back (see TargetKV). Attention reads the grouped K/V heads directly (`sdpa_grouped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def sdpa_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, but on CPU a masked call reads the grouped K/V heads as they are (enable_gqa).

    transformers expands K/V to every query head first whenever a mask is given (repeat_kv): a copy of the whole
    cache per layer per step, which on CPU cost more than the attention itself (measured: benchmarks/spec_speed.py).
    CPU SDPA takes grouped heads with a mask (the same sums); elsewhere transformers' own path runs.
    """
    if attention_mask is None or query.device.type != "cpu" or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa_grouped", sdpa_grouped)
AttentionMaskInterface.register("sdpa_grouped", sdpa_mask)


@dataclass
class TargetOutput:
    aux: Tensor  # [B, T, K·H] concatenated outputs of the capture layers, in target_layer_ids order
    last_hidden: Tensor  # [B, T, H] post-final-norm hidden state
    logits: Tensor | None  # [B, T, V] fp32 (or [B, 1, V] when only the last row was asked for)


class HFTarget:
    def __init__(self, model: PreTrainedModel, layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation("sdpa_grouped")
        self.decoder = model.get_decoder()
        n = len(self.decoder.layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {n} decoder layers")
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, Tensor] = {}
        for i in set(self.layer_ids):
            self.decoder.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @classmethod
    def from_pretrained(
        cls, path: str | Path, layer_ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> HFTarget:
        if not Path(path).exists():
            raise FileNotFoundError(f"target model folder {path} does not exist")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
        return cls(model, layer_ids)

    # ---- shape facts --------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ---- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: object | None = None,
        logits: str = "all",
    ) -> TargetOutput:
        """One target pass. logits: "all" rows, "last" row only, or "none"."""
        self._captured.clear()
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        h = out.last_hidden_state
        aux = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        rows = {"all": h, "last": h[:, -1:], "none": None}[logits]
        lg = None if rows is None else self.lm_head(rows).float()
        return TargetOutput(aux=aux, last_hidden=h, logits=lg)

    def capture(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> TargetOutput:
        """Prefill-only capture for training: aux + post-norm hidden for every token, no logits, no cache."""
        return self.forward(input_ids, attention_mask=attention_mask, logits="none")


class _RowCache:
    """The per-layer K/V buffers [B, kv_heads, capacity, head_dim] that HF attention layers write through `update`.

    TargetKV says where this forward's n new tokens go: the same columns `start .. start+n-1` for every row (one
    slice write), or per-row columns `cols` [B, n] (one indexed write); `width` is how many columns attention reads.
    Buffers are allocated at the first write (the layer's own head count, dim and dtype).
    """

    def __init__(self, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.start: int | None = 0
        self.cols: Tensor | None = None
        self.rows: Tensor | None = None
        self.width = 0

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args) -> tuple[Tensor, Tensor]:
        if layer_idx == len(self.keys):
            shape = (self.batch, key.shape[1], self.capacity, key.shape[3])
            self.keys.append(key.new_zeros(shape))
            self.values.append(value.new_zeros(shape))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.start is not None:
            k[:, :, self.start : self.start + key.shape[2]] = key
            v[:, :, self.start : self.start + key.shape[2]] = value
        else:
            k[self.rows, :, self.cols] = key.transpose(1, 2)  # [B, n, heads, d] at (row b, column cols[b, i])
            v[self.rows, :, self.cols] = value.transpose(1, 2)
        return k[:, :, : self.width], v[:, :, : self.width]

    def resize(self, rows: Tensor | None, first: int, capacity: int) -> None:
        """Keep these rows (all if None) and columns first.. (copied into buffers of the new capacity)."""
        def move(t: Tensor) -> Tensor:
            t = t if rows is None else t[rows]
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
            n = min(t.shape[2] - first, capacity)
            out[:, :, :n] = t[:, :, first : first + n]
            return out

        self.keys, self.values = [move(t) for t in self.keys], [move(t) for t in self.values]
        self.batch, self.capacity = (self.batch if rows is None else len(rows)), capacity


class TargetKV:
    """A batch of ragged requests in one preallocated KV cache, with per-request valid lengths.

    Prompts are left-padded so the prefill is one dense pass: row b's tokens fill columns pad[b] .. end[b]-1, at
    positions 0 .. end[b]-pad[b]-1. A forward writes each row's n new tokens in place at columns end[b] .. end[b]+n-1,
    reads columns < max(end)+n under a 4-D mask (each query sees its own row's valid columns up to itself) and moves
    end on by n. `commit` rolls rejected tokens back by moving end[b] back: they stay behind as stale columns that the
    mask hides and the row's next forward overwrites. So no step copies or re-aligns the cache; the buffers grow
    (doubling) when a row reaches capacity, and shrink when finished rows leave (`select`).
    """

    def __init__(self, target: HFTarget, prompts: list[list[int]], reserve: int = 0):
        """reserve: columns to allocate beyond the longest prompt (the tokens still to come, plus a verify block)."""
        self.target = target
        dev = target.device
        T = max(len(p) for p in prompts)
        self.pad = torch.tensor([T - len(p) for p in prompts], device=dev)
        self.ids = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], device=dev)
        self.end = torch.zeros(len(prompts), dtype=torch.long, device=dev)
        self._ends = [0] * len(prompts)  # host copy of end
        self.cache = _RowCache(len(prompts), T + max(reserve, 1))

    @property
    def width(self) -> int:
        """Columns in use: the longest row's end."""
        return max(self._ends)

    @property
    def lengths(self) -> Tensor:
        return self.end - self.pad

    def prefill(self, logits: str = "last") -> TargetOutput:
        return self.extend(self.ids, logits)

    def extend(self, new_ids: Tensor, logits: str = "all") -> TargetOutput:
        """Run new_ids [B, n] after each request's valid tokens (positions lengths .. lengths+n-1)."""
        B, n = new_ids.shape
        dev = new_ids.device
        cols = self.end[:, None] + torch.arange(n, device=dev)  # [B, n] where the new tokens go
        width = self.width + n
        if width > self.cache.capacity:
            self.cache.resize(None, 0, max(width, 2 * self.cache.capacity))
        c = self.cache
        uniform = min(self._ends) == max(self._ends)
        c.start, c.width = (self._ends[0] if uniform else None), width
        c.rows, c.cols = (None, None) if uniform else (torch.arange(B, device=dev)[:, None], cols)
        out = self.target.forward(new_ids, attention_mask=self._mask(cols, width),
                                  position_ids=(cols - self.pad[:, None]).clamp(min=0), cache=c, logits=logits)
        self.end = self.end + n
        self._ends = [e + n for e in self._ends]
        return out

    def _mask(self, cols: Tensor, width: int) -> Tensor:
        """[B, 1, n, width] bool: query i of row b sees its row's columns pad[b] .. cols[b, i] (a padding query
        only itself, so no row is empty)."""
        k = torch.arange(width, device=cols.device)
        q = cols[:, :, None]
        return (((k >= self.pad[:, None, None]) & (k <= q)) | (k == q))[:, None]

    def commit(self, n_new: int, keep: Tensor) -> None:
        """Of the last n_new tokens, keep the first keep[b] for each request; drop the rest (rollback)."""
        self.end = self.end - (n_new - keep.to(self.end.device))
        self._ends = self.end.tolist()

    def select(self, rows: Tensor) -> None:
        """Keep only these requests (finished ones leave the batch) and drop columns that are padding everywhere."""
        trim = int(self.pad[rows].min())
        self.cache.resize(rows, trim, self.cache.capacity - trim)
        self.pad = self.pad[rows] - trim
        self.end = self.end[rows] - trim
        self._ends = self.end.tolist()
