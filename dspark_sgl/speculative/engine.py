"""Reference speculative engine (pure torch, CPU or GPU): the executable specification of a DSpark step.

    prefill target (captures aux hidden) -> draft context K/V for the prompt -> first token = anchor
    loop: draft block [anchor, MASK…] -> Markov rollout -> target verifies [anchor, x_1..x_γ] in one pass
          -> accept (greedy | rejection | block) -> commit anchor + accepted (target KV kept, draft context added)
          -> emit accepted + bonus; the bonus is the next anchor

With no draft the same loop runs plain one-token decoding through the same target adapter (the timing baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.speculative.accept import ACCEPT_RULES, Acceptance, greedy_accept
from dspark_sgl.speculative.markov import Proposal, rollout
from dspark_sgl.speculative.sampling import draft_probs, next_token, target_probs
from dspark_sgl.targets.hf import HFTarget, TargetKV

# (proposal, limit-free) -> verify lengths [B] in 1..γ+1; see dspark_sgl.speculative.scheduler
VerifyPlanner = Callable[[Proposal], Tensor]


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    acceptance: Literal["rejection", "block"] = "rejection"  # used when temperature > 0
    seed: int = 0


@dataclass
class RequestStats:
    block_size: int
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    verified: list[int] = field(default_factory=list)  # drafts sent to the target per step
    confidence: list[list[float]] = field(default_factory=list)  # raw confidence logits per step (for STS)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target pass (accepted + bonus)."""
        return 1.0 + sum(self.accepted) / max(len(self.accepted), 1)

    @property
    def accept_hist(self) -> list[int]:
        """Count of steps that accepted exactly c drafts, c = 0..γ."""
        hist = [0] * (self.block_size + 1)
        for c in self.accepted:
            hist[c] += 1
        return hist

    @property
    def per_position_accept(self) -> list[float]:
        """P(draft k accepted), k = 1..γ: the fraction of steps whose accepted run reached k."""
        n = max(len(self.accepted), 1)
        return [sum(c >= k for c in self.accepted) / n for k in range(1, self.block_size + 1)]


@dataclass
class Generation:
    token_ids: list[int]
    stats: RequestStats
    finished: bool = False  # stopped on an EOS token


class SpecEngine:
    def __init__(self, target: HFTarget, draft: DSparkDraft | None = None, planner: VerifyPlanner | None = None):
        self.target, self.draft, self.planner = target, draft, planner
        if draft is not None:
            draft.config.validate(target.hidden_size, target.num_layers, target.vocab_size)
            if draft.config.target_layer_ids != target.layer_ids:
                raise ValueError(
                    f"target captures layers {target.layer_ids} but the draft expects {draft.config.target_layer_ids}"
                )
            draft.bind_target(target.embed_tokens, target.lm_head)

    @property
    def gamma(self) -> int:
        return self.draft.config.block_size if self.draft is not None else 0

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[Generation]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        s = sampling or SamplingConfig()
        gen = torch.Generator(device=self.target.device).manual_seed(s.seed)
        B = len(prompts)
        outs = [Generation([], RequestStats(self.gamma)) for _ in range(B)]
        kv = TargetKV(self.target, prompts)
        t0 = time.perf_counter()
        first = kv.prefill(logits="last")
        anchor = next_token(first.logits[:, -1], s.temperature, s.top_p, gen)
        ctx = None
        if self.draft is not None:
            ctx = DraftContextCache(self.draft, B, self.target.device, self.draft.fc.weight.dtype)
            ctx.append(first.aux, kv.lengths, start=kv.pad)
        for b in range(B):
            outs[b].stats.verify_s += time.perf_counter() - t0
        self._emit(outs, [[int(t)] for t in anchor], eos_token_ids, max_new_tokens)
        live = list(range(B))  # rows of the batch still generating; finished ones leave the batch
        while True:
            keep = [j for j, i in enumerate(live) if not (outs[i].finished or len(outs[i].token_ids) >= max_new_tokens)]
            if not keep:
                return outs
            if len(keep) < len(live):
                rows = torch.tensor(keep, device=anchor.device)
                kv.select(rows)
                if ctx is not None:
                    ctx.select(rows)
                anchor, live = anchor[rows], [live[j] for j in keep]
            batch = [outs[i] for i in live]
            if self.draft is None:
                anchor = self._plain_step(kv, anchor, s, gen, batch, eos_token_ids, max_new_tokens)
            else:
                anchor = self._spec_step(kv, ctx, anchor, s, gen, batch, eos_token_ids, max_new_tokens)

    def _plain_step(self, kv, anchor, s, gen, outs, eos, max_new) -> Tensor:
        t0 = _sync_time(anchor)
        out = kv.extend(anchor[:, None], logits="last")
        nxt = next_token(out.logits[:, -1], s.temperature, s.top_p, gen)
        dt = _sync_time(nxt) - t0
        for o in outs:
            o.stats.verify_s += dt
        self._emit(outs, [[int(t)] for t in nxt], eos, max_new)
        return nxt

    def _spec_step(self, kv: TargetKV, ctx: DraftContextCache, anchor: Tensor, s, gen, outs, eos, max_new) -> Tensor:
        draft, gamma = self.draft, self.gamma
        t0 = _sync_time(anchor)
        h = draft.forward_step(anchor, ctx)
        prop = rollout(draft, h, anchor, s.temperature, gen)
        limit = None
        n_verify = gamma + 1
        if self.planner is not None:
            limit = (self.planner(prop) - 1).clamp(0, gamma)
            n_verify = int(limit.max()) + 1  # the target runs only the longest scheduled prefix
        t1 = _sync_time(prop.tokens)
        verify_ids = torch.cat((anchor[:, None], prop.tokens[:, : n_verify - 1]), 1)
        out = kv.extend(verify_ids, logits="all")
        res = self._accept(prop, out.logits, limit, s, gen, n_verify - 1)
        keep = res.num_accepted + 1  # the anchor and the accepted drafts now have target KV
        kv.commit(n_verify, keep)
        t2 = _sync_time(res.bonus)
        ctx.append(out.aux, keep)
        t3 = _sync_time(ctx.lengths)
        emitted = []
        for b, o in enumerate(outs):
            c = int(res.num_accepted[b])
            if not (o.finished or len(o.token_ids) >= max_new):
                o.stats.accepted.append(c)
                o.stats.verified.append(n_verify - 1 if limit is None else int(limit[b]))
                if prop.conf_logits is not None:
                    o.stats.confidence.append(prop.conf_logits[b].tolist())
                o.stats.draft_s += (t1 - t0) + (t3 - t2)
                o.stats.verify_s += t2 - t1
            emitted.append(prop.tokens[b, :c].tolist() + [int(res.bonus[b])])
        self._emit(outs, emitted, eos, max_new)
        return res.bonus

    def _accept(self, prop: Proposal, logits: Tensor, limit, s: SamplingConfig, gen, n_drafts: int) -> Acceptance:
        x = prop.tokens[:, :n_drafts]
        if s.temperature <= 0:
            return greedy_accept(x, logits, limit)
        p = target_probs(logits, s.temperature, s.top_p)
        q = draft_probs(prop.logits[:, :n_drafts], s.temperature)
        return ACCEPT_RULES[s.acceptance](x, q, p, limit, gen)

    @staticmethod
    def _emit(outs: list[Generation], tokens: list[list[int]], eos, max_new: int) -> None:
        for o, toks in zip(outs, tokens, strict=True):
            for t in toks:
                if o.finished or len(o.token_ids) >= max_new:
                    break
                o.token_ids.append(t)
                o.finished = t in eos


def _sync_time(t: Tensor) -> float:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return time.perf_counter()


def profile_target_sps(target: HFTarget, max_tokens: int, context: int = 128, repeats: int = 3):
    """Steps/s of the target verify forward for 1..max_tokens new tokens after `context` cached tokens."""
    from dspark_sgl.speculative.sps import default_token_counts, profile_sps

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context + max_tokens), generator=g).to(target.device)
    kv = TargetKV(target, [ids[0, :context].tolist()])
    kv.prefill()
    zero = torch.zeros(1, dtype=torch.long, device=target.device)

    def step(n: int) -> None:
        kv.extend(ids[:, context : context + n])
        kv.commit(n, zero)  # roll the probe tokens back

    sync = torch.cuda.synchronize if target.device.type == "cuda" else None
    return profile_sps(step, default_token_counts(max_tokens), warmup=1, repeats=repeats, sync=sync)


def confidence_planner(target: HFTarget, draft: DSparkDraft, sps_path=None, max_batch: int = 8):
    """The `confidence` schedule: SPS table from sps_path (or profiled now), STS temperatures from the draft."""
    from dspark_sgl.speculative.scheduler import ConfidencePlanner
    from dspark_sgl.speculative.sps import SpsTable

    if draft.confidence_head is None:
        raise ValueError("--schedule confidence needs a draft with a confidence head")
    sps = SpsTable.load(sps_path) if sps_path else profile_target_sps(target, max_batch * (draft.config.block_size + 1))
    temps = draft.config.sts_temperatures
    return ConfidencePlanner(sps, None if temps is None else torch.tensor(temps), "confidence")
