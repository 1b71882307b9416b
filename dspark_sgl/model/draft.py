"""The DSpark draft, top to bottom.

A DSpark draft is a small Qwen3-style decoder that predicts γ tokens in one non-causal pass:

    context c   = RMSNorm_hidden(fc(concat(target aux hidden states)))     one vector per committed token
    block input = target_embed([anchor, MASK, ..., MASK])                   γ rows at positions a .. a+γ-1
                  (+ anchor_proj(c[a-1]) on every row, opt-in `anchor_state`)
    each layer  : queries from the block; keys/values = [K/V(c) of tokens < a ; K/V(block)]
    h           = final RMSNorm; base logits = target_lm_head(h)
    Markov head : bias_t = W2 · latent(prev_t, h_t, state) added to base logits, prev_0 = anchor (sequential)
    confidence  : c_t = σ(w · [h_t ; E1[prev_t]] + b), fp32

Training runs all anchor blocks of a sequence in ONE forward (each block sees context < its anchor and its own
block); inference runs one block per request against a context K/V cache. Both call the same `forward_blocks`
with the same mask rule, so the two paths cannot drift apart.

An MLA draft (`attention_type: mla`, the Inferact/Kimi-K3 layout vLLM's `dspark` method loads) swaps the attention
for DeepSeek/Kimi MLA and uses vLLM's names for the context path (`context_proj`, `context_norm`, `final_norm`):
its "context K/V" per token is the target's own MLA cache entry, a latent of kv_lora_rank (normed) + qk_rope_head_dim
(roped) values from `kv_a_proj_with_mqa(c)`, and `kv_b_proj` expands latent to per-head keys/values inside attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_sgl.config import DSparkConfig
from dspark_sgl.faults import planted


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: DSparkConfig) -> Tensor:
    """Inverse frequencies for neox-style RoPE over the full head_dim (default or linear scaling)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind not in ("default", None):
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported by the draft yet")
    return inv.float()


def apply_rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """x [B, heads, T, d], pos [B, T] absolute positions."""
    freqs = pos.to(torch.float32)[:, None, :, None] * inv_freq.to(x.device)  # [B,1,T,d/2]
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # [B, n, T, d]

    def kv(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of rows x (block tokens or context vectors): k = RoPE(k_norm(W_k x)), v = W_v x."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), pos, inv_freq)
        return k, self._heads(self.v_proj(x), self.n_kv)

    def forward(self, x: Tensor, pos: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor, inv_freq: Tensor) -> Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), pos, inv_freq)
        k, v = self.kv(x, pos, inv_freq)
        k, v = torch.cat((ctx_k, k), dim=2), torch.cat((ctx_v, v), dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(o.transpose(1, 2).reshape(*x.shape[:2], -1))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope(config: DSparkConfig) -> tuple[Tensor, float, float]:
    """(inv_freq over qk_rope_head_dim, cos/sin scale, softmax scale) for an MLA draft: default, linear or DeepSeek
    YaRN scaling (the target's own `rope_parameters`, as vLLM's DeepseekScalingRotaryEmbedding computes them)."""
    d, base = config.qk_rope_head_dim, config.rope_theta
    exps = torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d  # cpu even under a meta-device build
    inv = 1.0 / (base**exps)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    softmax_scale = (config.qk_nope_head_dim + d) ** -0.5
    cos_scale = 1.0
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind in ("yarn", "deepseek_yarn"):
        factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        fast, slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
        dim_of = lambda rot: d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)  # low frequencies interpolated, high ones kept
        mscale, mscale_all = float(scaling.get("mscale", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
        cos_scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        softmax_scale *= yarn_mscale(factor, mscale_all) ** 2
    elif kind not in ("default", None):
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported by the MLA draft yet")
    return inv.float(), cos_scale, softmax_scale


def apply_rope_interleaved(x: Tensor, pos: Tensor, inv_freq: Tensor, scale: float = 1.0) -> Tensor:
    """GPT-J (interleaved-pair) RoPE, the DeepSeek/Kimi MLA convention: x [B, heads, T, d], pos [B, T]."""
    freqs = pos.to(torch.float32)[:, None, :, None] * inv_freq.to(x.device)  # [B,1,T,d/2]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(x.dtype)


class MLAAttention(nn.Module):
    """Kimi-K3 / DeepSeek MLA with DSpark's dual-source keys (vLLM `K3DSparkModel`, TorchSpec `K3DSparkMLAAttention`).

    Context and block rows both enter through `kv_a_proj_with_mqa`; what is cached per context token is the latent
    (kv_a_layernorm(c_kv), RoPE(k_pe)) — 512 + 64 values for K3, the layout of the target's own MLA pages. Keys and
    values are expanded from the latent by `kv_b_proj` (the unabsorbed form: the reference, not the fast kernel).
    """

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_dim = (
            c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim)
        self.kv_lora_rank = c.kv_lora_rank
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=False)
        _, self.cos_scale, self.softmax_scale = mla_rope(c)

    def kv(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """Latent cache entries of rows x: (kv_a_layernorm(c_kv) [B, 1, T, kv_lora], RoPE(k_pe) [B, 1, T, rope])."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rope_interleaved(k_pe[:, None], pos, inv_freq, self.cos_scale)
        return self.kv_a_layernorm(c_kv)[:, None], k_pe

    def forward(self, x: Tensor, pos: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor, inv_freq: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.n_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, apply_rope_interleaved(q_pe, pos, inv_freq, self.cos_scale)), dim=-1)
        c_kv, k_pe = self.kv(x, pos, inv_freq)
        c_kv, k_pe = torch.cat((ctx_k, c_kv), dim=2)[:, 0], torch.cat((ctx_v, k_pe), dim=2)  # [B,S,r], [B,1,S,d]
        kv = self.kv_b_proj(c_kv).view(B, c_kv.shape[1], self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, self.n_heads, -1, -1)), dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c) if c.is_mla else Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        mask: Tensor,
        inv_freq: Tensor,
        ctx_kv: tuple[Tensor, Tensor] | None = None,
        ctx: Tensor | None = None,
        ctx_pos: Tensor | None = None,
    ) -> Tensor:
        """Context K/V arrive precomputed (inference cache) or are projected here from ctx (training). Projecting
        inside the layer's own forward is what lets per-layer FSDP gather this layer's weights for it."""
        k, v = ctx_kv if ctx_kv is not None else self.self_attn.kv(ctx, ctx_pos, inv_freq)
        x = x + self.self_attn(self.input_layernorm(x), pos, k, v, mask, inv_freq)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Low-rank previous-token logit bias: bias = W2 · latent, latent from E1[prev] (and h, state)."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.kind, r, H = c.markov_head_type, c.markov_rank, c.hidden_size
        self.markov_w1 = nn.Embedding(c.vocab_size, r)  # the previous token may be any target token
        self.markov_w2 = nn.Linear(r, c.draft_vocab, bias=False)  # the bias covers the K draft tokens
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def latent(self, prev: Tensor, h: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One step: prev [...] token ids, h [..., H] draft hidden at this row -> (latent [..., r], new state)."""
        e = self.markov_w1(prev).to(h.dtype)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat((h, e), -1))) * e, None
        state = torch.zeros_like(e) if state is None else state
        a, cand, o = self.joint_proj(torch.cat((state, e, h), -1)).chunk(3, dim=-1)
        g = torch.sigmoid(a)
        state = g * state + (1 - g) * torch.tanh(cand)
        return torch.tanh(o), state

    def teacher_forced_latent(self, prev: Tensor, h: Tensor) -> Tensor:
        """prev [..., γ] ground-truth previous tokens, h [..., γ, H] -> latent [..., γ, r] (rnn runs the scan)."""
        if self.kind != "rnn":
            return self.latent(prev, h, None)[0]
        state, out = None, []
        for t in range(prev.shape[-1]):
            z, state = self.latent(prev[..., t], h[..., t, :], state)
            out.append(z)
        return torch.stack(out, dim=-2)

    def bias(self, latent: Tensor) -> Tensor:
        return self.markov_w2(latent)


class ConfidenceHead(nn.Module):
    """P(draft token t survives | prefix accepted) logit; kept in fp32 whatever the model dtype."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.with_markov = c.confidence_head_with_markov
        self.proj = nn.Linear(c.hidden_size + (c.markov_rank if self.with_markov else 0), 1)

    def forward(self, h: Tensor, prev_emb: Tensor | None) -> Tensor:
        x = torch.cat((h, prev_emb), -1) if self.with_markov else h
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)

    def _apply(self, fn, recurse=True):  # keep fp32 under .to(dtype) / .half()
        super()._apply(fn, recurse)
        for p in self.parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return self


def block_attention_mask(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """Bool mask [B, 1, N·γ, ctx_len + N·γ] for N blocks per row.

    Block n (anchor position a) sees context positions < a and all γ tokens of its own block, nothing else.
    Inference is the N=1 case with a = number of committed tokens that have context K/V.
    """
    B, N = anchors.shape
    dev = anchors.device
    q_block = torch.arange(N * block_size, device=dev) // block_size  # block index of each query row
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, :, None]  # [B, N, S]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [B, N·γ, S]
    own = (q_block[:, None] == q_block[None, :]).expand(B, -1, -1)  # [B, N·γ, N·γ]
    return torch.cat((ctx, own), dim=-1)[:, None]


@dataclass
class TargetHeads:
    """The frozen target embedding and lm_head the draft borrows; never part of the draft's state dict."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    hot_dtype: torch.dtype | None = None  # dtype of the gathered hot rows (None: the lm_head's own)
    hot_weight: Tensor | None = None  # reduced vocabulary: lm_head rows of the K draft tokens, gathered at bind
    hot_key: tuple | None = None  # (d2t version, device, dtype) the gather was made for


MLA_ALIASES = {"fc": "context_proj", "hidden_norm": "context_norm", "norm": "final_norm"}  # GQA name -> vLLM MLA name


class DSparkDraft(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        c = config
        if c.is_mla:  # vLLM's K3DSparkModel names, so a folder we save is the folder vLLM loads
            self.context_proj = nn.Linear(c.num_aux * c.hidden_size, c.hidden_size, bias=False)
            self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        else:
            self.fc = nn.Linear(c.num_aux * c.hidden_size, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        if c.is_mla:
            self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            for alias, name in MLA_ALIASES.items():  # one spelling for every caller; not a second registration
                object.__setattr__(self, alias, getattr(self, name))
        else:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = MarkovHead(c)
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if c.own_embed_tokens else None
        self.anchor_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False) if c.anchor_state else None
        # fp32 always; a plain attribute so .to(bf16) cannot round it
        self._inv_freq = mla_rope(c)[0] if c.is_mla else rope_inv_freq(c)
        self._target: TargetHeads | None = None
        if c.reduced_vocab:  # EAGLE-3 / speculators convention: draft id i is target id i + d2t[i]
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @property
    def inv_freq(self) -> Tensor:
        if self._inv_freq.device != self.fc.weight.device and not self.fc.weight.is_meta:
            self._inv_freq = self._inv_freq.to(self.fc.weight.device)
        return self._inv_freq

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, block_size: int | None = None) -> DSparkDraft:
        from dspark_sgl.model.checkpoint import load_draft

        return load_draft(path, device=device, dtype=dtype, block_size=block_size)

    def save_pretrained(self, path) -> None:
        from dspark_sgl.model.checkpoint import save_draft

        save_draft(self, path)

    # ---- target heads ------------------------------------------------------------------------------------
    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module, hot_dtype: torch.dtype | None = None
                    ) -> DSparkDraft:
        """Borrow the target's frozen embedding and lm_head (kept outside the module tree: never saved/trained).
        hot_dtype: the dtype the K hot rows of a reduced vocabulary are gathered in (default: the lm_head's); a
        serving draft cheaper than its target (bf16 beside fp32) passes its own, so it scores them at its speed."""
        self._target = TargetHeads(embed_tokens, lm_head, hot_dtype)
        if self.config.reduced_vocab and not self.d2t.is_meta:
            self.head_weight()  # gather the K hot lm_head rows now, not in the first draft step
        return self

    @property
    def target(self) -> TargetHeads:
        if self._target is None:
            raise RuntimeError("DSparkDraft has no target heads: call draft.bind_target(embed_tokens, lm_head) first")
        return self._target

    def embed(self, ids: Tensor) -> Tensor:
        if self.embed_tokens is not None:  # own (trained) embedding: the Inferact K3 draft's choice
            return self.embed_tokens(ids)
        return self.target.embed_tokens(ids).to(self.fc.weight.dtype)

    # ---- reduced draft vocabulary ------------------------------------------------------------------------
    @property
    def vocab(self) -> Tensor | None:
        """Target ids of the K draft tokens (draft id i -> vocab[i]); None for a full-vocabulary draft."""
        if not self.config.reduced_vocab:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_vocab(self, target_ids: Tensor) -> None:
        """Make these K target ids (sorted here) the draft vocabulary: d2t[i] = target_ids[i] - i."""
        ids = check_vocab(torch.as_tensor(target_ids, dtype=torch.long).flatten().sort().values,
                          self.config.draft_vocab, self.config.vocab_size)
        with torch.no_grad():
            self.d2t.copy_((ids - torch.arange(ids.shape[0])).to(self.d2t.device))

    def head_weight(self) -> Tensor:
        """The lm_head rows the draft scores: all V (the target's own tensor), or the K hot rows, gathered once per
        d2t, device and dtype (see bind_target)."""
        head = self.target.lm_head
        if not self.config.reduced_vocab:
            return head.weight
        t = self.target
        dtype = t.hot_dtype or head.weight.dtype
        key = (self.d2t._version, self.d2t.data_ptr(), head.weight.device, head.weight.data_ptr(), dtype)
        if t.hot_key != key:
            t.hot_weight = head.weight.detach()[self.vocab.to(head.weight.device)].to(dtype).contiguous()
            t.hot_key = key
        return t.hot_weight

    def base_logits(self, h: Tensor) -> Tensor:
        w = self.head_weight()
        return F.linear(h.to(w.dtype), w).float()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        # The Markov bias is the product W2 · W1[prev]: with both factors at `std` it starts at a saddle (each
        # factor's gradient is scaled by the other) and stays near zero for hundreds of steps. W1 is an embedding
        # table and starts at unit scale like one, so W2 learns from the first step while the bias starts small.
        nn.init.normal_(self.markov_head.markov_w1.weight, std=1.0)
        if self.anchor_proj is not None:  # starts as the draft without it: the path is learnt, never a shock
            nn.init.zeros_(self.anchor_proj.weight)

    # ---- the one forward ---------------------------------------------------------------------------------
    def project_context(self, aux_hidden: Tensor) -> Tensor:
        """[..., K·H] concatenated target aux hidden states -> context vectors [..., H]."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context K/V [B, kv_heads, S, d] for context vectors ctx [B, S, H] at positions pos [B, S]."""
        return [layer.self_attn.kv(ctx, pos, self.inv_freq) for layer in self.layers]

    def context_kv_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of the cached K and V per token: GQA K/V heads, or MLA's latent (1, kv_lora) + (1, rope)."""
        c = self.config
        if c.is_mla:
            return (1, c.kv_lora_rank), (1, c.qk_rope_head_dim)
        return (c.num_key_value_heads, c.head_dim), (c.num_key_value_heads, c.head_dim)

    def forward_blocks(
        self,
        x: Tensor,
        pos: Tensor,
        mask: Tensor,
        ctx_kv: list[tuple[Tensor, Tensor]] | None = None,
        ctx: Tensor | None = None,
        ctx_pos: Tensor | None = None,
    ) -> Tensor:
        """Block rows x [B, Q, H] at pos [B, Q] -> final-normed hidden [B, Q, H].

        Context comes either as per-layer K/V (inference) or as context vectors ctx [B, S, H] at ctx_pos (training).
        """
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, mask, self.inv_freq, None if ctx_kv is None else ctx_kv[i], ctx, ctx_pos)
        return self.norm(x)

    def block_inputs(self, anchor_ids: Tensor, anchor_pos: Tensor) -> tuple[Tensor, Tensor]:
        """[anchor, MASK × (γ−1)] ids and positions for anchors [B, N] -> ([B, N·γ], [B, N·γ])."""
        g = self.config.block_size
        ids = torch.full((*anchor_ids.shape, g), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[..., 0] = anchor_ids
        pos = anchor_pos[..., None] + torch.arange(g, device=anchor_pos.device)
        return ids.flatten(1), pos.flatten(1)

    def block_rows(self, ids: Tensor, prev_ctx: Tensor | None) -> Tensor:
        """The block rows [B, N·γ, H]: token embeddings of ids [B, N·γ], plus, with `anchor_state`, anchor_proj of
        the context vector before each block's anchor (prev_ctx [B, N, H]) on every row of that block."""
        x = self.embed(ids)
        if self.anchor_proj is None:
            return x
        B, N, g = x.shape[0], prev_ctx.shape[1], self.config.block_size
        add = self.anchor_proj(prev_ctx.to(self.anchor_proj.weight.dtype)).to(x.dtype)
        return (x.view(B, N, g, -1) + add[:, :, None]).view_as(x)

    def forward_train(self, input_ids: Tensor, aux_hidden: Tensor, anchors: Tensor) -> Tensor:
        """All anchor blocks of each sequence in one forward.

        input_ids [B, S], aux_hidden [B, S, K·H] (token p's capture at position p), anchors [B, N] positions.
        Returns h [B, N, γ, H]: slot k of block n predicts token anchors[n] + k + 1.
        """
        B, S = input_ids.shape
        ctx_pos = torch.arange(S, device=input_ids.device).expand(B, S)
        ctx = self.project_context(aux_hidden)
        ids, pos = self.block_inputs(input_ids.gather(1, anchors), anchors)
        mask = block_attention_mask(anchors, S, self.config.block_size)
        prev = None
        if self.anchor_proj is not None:  # ctx[a-1]; an anchor at 0 has no token before it: zeros
            before = (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, ctx.shape[-1])
            prev = ctx.gather(1, before) * (anchors > 0)[..., None].to(ctx.dtype)
        h = self.forward_blocks(self.block_rows(ids, prev), pos, mask, ctx=ctx, ctx_pos=ctx_pos)
        return h.view(B, anchors.shape[1], self.config.block_size, -1)

    def forward_step(self, anchor_ids: Tensor, cache: DraftContextCache) -> Tensor:
        """One block per request at inference: anchors [B] at positions cache.lengths -> h [B, γ, H]."""
        ids, pos = self.block_inputs(anchor_ids[:, None], cache.lengths[:, None])
        mask = block_attention_mask(cache.lengths[:, None], cache.capacity, self.config.block_size)
        prev = None if self.anchor_proj is None else cache.last[:, None]
        return self.forward_blocks(self.block_rows(ids, prev), pos, mask, ctx_kv=cache.kv())


class DraftContextCache:
    """Context K/V of committed tokens for every draft layer, one row per request (ragged, right-padded)."""

    def __init__(self, draft: DSparkDraft, batch_size: int, device: torch.device | str, dtype: torch.dtype):
        c = draft.config
        self.draft = draft
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        (nk, dk), (nv, dv) = draft.context_kv_dims()
        self.k = [torch.zeros(batch_size, nk, 0, dk, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(batch_size, nv, 0, dv, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        # anchor_state: the context vector of each request's last committed token (zeros before the first)
        self.last = torch.zeros(batch_size, c.hidden_size, device=device, dtype=dtype) if c.anchor_state else None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def kv(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.k, self.v, strict=True))

    def select(self, rows: Tensor) -> None:
        """Keep only these requests (rows of the batch)."""
        self.k, self.v = [t[rows] for t in self.k], [t[rows] for t in self.v]
        self.lengths = self.lengths[rows]
        if self.last is not None:
            self.last = self.last[rows]

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        extra = max(needed - self.capacity, 64)
        pad = lambda t: torch.cat((t, t.new_zeros(*t.shape[:2], extra, t.shape[3])), dim=2)
        self.k, self.v = [pad(t) for t in self.k], [pad(t) for t in self.v]

    @torch.no_grad()
    def append(self, aux_hidden: Tensor, counts: Tensor, start: Tensor | None = None) -> None:
        """Add context for rows start[b] .. start[b]+counts[b]-1 of aux_hidden [B, n, K·H] (start defaults to 0),
        placed right after each request's committed tokens."""
        B, n, _ = aux_hidden.shape
        start = torch.zeros_like(counts) if start is None else start
        pos = self.lengths[:, None] - start[:, None] + torch.arange(n, device=aux_hidden.device)
        ctx = self.draft.project_context(aux_hidden)
        new_kv = self.draft.context_kv(ctx, pos.clamp(min=0))
        self._grow(int((self.lengths + counts).max()))
        for b in range(B):
            s, a, m = int(self.lengths[b]), int(start[b]), int(counts[b])
            for (k, v), ck, cv in zip(new_kv, self.k, self.v, strict=True):
                ck[b, :, s : s + m] = k[b, :, a : a + m]
                cv[b, :, s : s + m] = v[b, :, a : a + m]
            if self.last is not None and m > 0:
                at = a + m - 2 if planted("anchor_last") and m > 1 else a + m - 1
                self.last[b] = ctx[b, at].to(self.last.dtype)
        self.lengths += counts.to(self.lengths.device)


def check_vocab(ids: Tensor, size: int, vocab_size: int) -> Tensor:
    """Target ids of a draft vocabulary: exactly `size` distinct ids in [0, vocab_size)."""
    if ids.numel() != size:
        raise ValueError(f"draft vocabulary has {ids.numel()} ids, draft_vocab_size is {size}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    if ids.unique().numel() != ids.numel():
        raise ValueError("draft vocabulary ids must be distinct (d2t maps two draft ids to one target id)")
    return ids


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
