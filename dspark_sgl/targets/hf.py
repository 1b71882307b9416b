"""Embedded target adapter over transformers causal LMs.

Convention (the same everywhere in this project, SGLang capture included): aux layer id i is the OUTPUT of
decoder layer i (HF `hidden_states[i + 1]`), i.e. the residual stream before layer i+1's input norm. We read it
with forward hooks on the decoder layers, so no full `output_hidden_states` stack is materialised.

`TargetKV` keeps a batch of ragged requests in one left-padded HF cache. After a verify pass each request keeps a
different number of the new positions; `commit` shifts every row so that its valid tokens end at the same column
again (one gather per layer), which keeps the cache dense instead of riddled with holes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel


@dataclass
class TargetOutput:
    aux: Tensor  # [B, T, K·H] concatenated outputs of the capture layers, in target_layer_ids order
    last_hidden: Tensor  # [B, T, H] post-final-norm hidden state
    logits: Tensor | None  # [B, T, V] fp32 (or [B, 1, V] when only the last row was asked for)


class HFTarget:
    def __init__(self, model: PreTrainedModel, layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
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
        cache: DynamicCache | None = None,
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
        aux = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        rows = {"all": h, "last": h[:, -1:], "none": None}[logits]
        lg = None if rows is None else self.lm_head(rows).float()
        return TargetOutput(aux=aux, last_hidden=h, logits=lg)

    def capture(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> TargetOutput:
        """Prefill-only capture for training: aux + post-norm hidden for every token, no logits, no cache."""
        return self.forward(input_ids, attention_mask=attention_mask, logits="none")


class TargetKV:
    """A left-padded batch of requests in one HF DynamicCache, with per-request valid lengths."""

    def __init__(self, target: HFTarget, prompts: list[list[int]]):
        self.target = target
        dev = target.device
        T = max(len(p) for p in prompts)
        self.pad = torch.tensor([T - len(p) for p in prompts], device=dev)
        self.ids = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], device=dev)
        self.cache = DynamicCache(config=target.config)
        self.width = 0  # columns in the cache

    @property
    def lengths(self) -> Tensor:
        return self.width - self.pad

    def _mask(self, extra: int) -> Tensor:
        cols = torch.arange(self.width + extra, device=self.pad.device)
        return (cols[None, :] >= self.pad[:, None]).long()

    def prefill(self, logits: str = "last") -> TargetOutput:
        T = self.ids.shape[1]
        mask = self._mask(T)
        pos = (torch.arange(T, device=self.pad.device)[None] - self.pad[:, None]).clamp(min=0)
        out = self.target.forward(self.ids, attention_mask=mask, position_ids=pos, cache=self.cache, logits=logits)
        self.width = T
        return out

    def extend(self, new_ids: Tensor, logits: str = "all") -> TargetOutput:
        """Run new_ids [B, n] after each request's valid tokens (positions lengths .. lengths+n-1)."""
        n = new_ids.shape[1]
        pos = self.lengths[:, None] + torch.arange(n, device=new_ids.device)
        out = self.target.forward(
            new_ids, attention_mask=self._mask(n), position_ids=pos, cache=self.cache, logits=logits
        )
        self.width += n
        return out

    def commit(self, n_new: int, keep: Tensor) -> None:
        """Of the last n_new columns, keep the first keep[b] for each request; drop the rest (rollback)."""
        drop = n_new - keep
        if int(drop.max()) == 0:
            return
        max_keep = int(keep.max())
        new_width = self.width - n_new + max_keep
        shift = max_keep - keep  # right-shift per row so every row ends at new_width
        cols = torch.arange(new_width, device=keep.device)[None, :] - shift[:, None]  # source column
        src = cols.clamp(min=0)
        for layer in self.cache.layers:
            idx = src[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.pad = self.pad + shift
        self.width = new_width

    def select(self, rows: Tensor) -> None:
        """Keep only these requests (finished ones leave the batch) and drop columns that are padding everywhere."""
        trim = int(self.pad[rows].min())
        for layer in self.cache.layers:
            layer.keys = layer.keys[rows, :, trim:]
            layer.values = layer.values[rows, :, trim:]
        self.pad = self.pad[rows] - trim
        self.width -= trim
