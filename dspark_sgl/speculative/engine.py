"""Reference speculative engine (pure torch, CPU or GPU): the executable specification of a DSpark step.

    prefill target (captures aux hidden) -> draft context K/V for the prompt -> first token = anchor
    loop: draft block [anchor, MASK…] -> Markov rollout -> target verifies [anchor, x_1..x_γ] in one pass
          -> accept (greedy | rejection | block) -> commit anchor + accepted (target KV kept, draft context added)
          -> emit accepted + bonus; the bonus is the next anchor

With no draft the same loop runs plain one-token decoding through the same target adapter (the timing baseline).
With a full-cost planner (scheduler.AdaptivePlanner) each step first decides, from earlier steps only, whether to
speculate at all; an "off" step is that same plain decode, which also appends the anchor's draft context so the draft
can resume at any later step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from dspark_sgl.faults import planted
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.speculative.markov import Proposal
from dspark_sgl.speculative.match import Choice, MatchChooser, MatchConfig, MatchState, MatchStep
from dspark_sgl.speculative.rows import accept_rows, next_tokens, propose, step_noise
from dspark_sgl.speculative.scheduler import AdaptivePlanner, draft_rows
from dspark_sgl.speculative.target_dist import BatchSampling, OutputHistory, RequestSampling, adjust_logits
from dspark_sgl.speculative.timing import PHASES, STEP_PHASES, StepTimer
from dspark_sgl.targets.hf import HFTarget, TargetKV

# (proposal, limit-free) -> verify lengths [B] in 1..γ+1; see dspark_sgl.speculative.scheduler
VerifyPlanner = Callable[[Proposal], Tensor]


@dataclass
class SamplingConfig(RequestSampling):
    """The request's sampling (RequestSampling, applied to every prompt unless generate() gets one per prompt),
    the acceptance rule for sampled rows, and the seed of the engine's generator (rows without a sampling_seed)."""

    acceptance: Literal["rejection", "block"] = "rejection"
    seed: int = 0


@dataclass
class RequestStats:
    block_size: int
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    verified: list[int] = field(default_factory=list)  # drafts sent to the target per step
    confidence: list[list[float]] = field(default_factory=list)  # raw confidence logits per step (for STS)
    from_match: list[bool] = field(default_factory=list)  # per step: verified a match from the text (--match)
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_split: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # with time_split

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
    def __init__(self, target: HFTarget, draft: DSparkDraft | None = None, planner: VerifyPlanner | None = None,
                 time_split: bool = False, match: MatchConfig | None = None):
        """time_split: also record where each draft step's time goes (RequestStats.draft_split; syncs on CUDA).
        match: each step verifies the draft's block or a match from the request's own text, whichever is expected to
        commit more (speculative/match.py; counters in self.matcher.counters)."""
        self.target, self.draft, self.planner, self.time_split = target, draft, planner, time_split
        self.matcher = MatchChooser(match) if match is not None and draft is not None else None
        # Engine totals over every generate() call (callers difference two readings): seconds per STEP_PHASES phase
        # summed over decode steps, the steps, and the prefill seconds.
        self.step_s, self.steps, self.prefill_s = dict.fromkeys(STEP_PHASES, 0.0), 0, 0.0
        self.calls = 0  # generate() calls so far: a request's key for the rule is (call, row)
        if draft is not None:
            draft.config.validate(target.hidden_size, target.num_layers, target.vocab_size)
            if draft.config.target_layer_ids != target.layer_ids:
                raise ValueError(
                    f"target captures layers {target.layer_ids} but the draft expects {draft.config.target_layer_ids}"
                )
            draft.bind_target(target.embed_tokens, target.lm_head, hot_dtype=draft.fc.weight.dtype)

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
        requests: list[RequestSampling] | None = None,
    ) -> list[Generation]:
        """requests: one RequestSampling per prompt (mixed greedy / sampled rows, penalties, seeds); default: all
        prompts use `sampling`. A row stops at an EOS token or one of its stop_token_ids."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        s = sampling or SamplingConfig()
        requests = requests if requests is not None else [s] * len(prompts)
        if len(requests) != len(prompts):
            raise ValueError(f"{len(requests)} sampling settings for {len(prompts)} prompts")
        for r in requests:
            r.validate(self.target.vocab_size)
        rows = [replace(r, stop_token_ids=frozenset(r.stop_token_ids) | frozenset(eos_token_ids)) for r in requests]
        stops = [r.stop_token_ids for r in rows]
        bs = BatchSampling.from_requests(rows, self.target.vocab_size, self.target.device)
        gen = torch.Generator(device=self.target.device).manual_seed(s.seed)
        B = len(prompts)
        outs = [Generation([], RequestStats(self.gamma)) for _ in range(B)]
        kv = TargetKV(self.target, prompts, reserve=max_new_tokens + self.gamma + 1)
        t0 = time.perf_counter()
        first = kv.prefill(logits="last")
        anchor = self._next_tokens(first.logits[:, -1], bs, gen, prompts, outs, range(B))
        ctx = None
        if self.draft is not None:
            ctx = DraftContextCache(self.draft, B, self.target.device, self.draft.fc.weight.dtype)
            ctx.append(first.aux, kv.lengths, start=kv.pad)
        dt = _sync_time(anchor) - t0
        self.prefill_s += dt
        for b in range(B):
            outs[b].stats.verify_s += dt
        # token counts of each row's output so far, kept up to date as tokens are emitted (penalties only)
        hist = OutputHistory.from_lists([[] for _ in range(B)], self.target.vocab_size, anchor.device) \
            if bs.any_penalty else None
        self._emit(outs, [[int(t)] for t in anchor], stops, max_new_tokens, hist)
        matches = None if self.matcher is None else \
            [self.matcher.new_state(p + o.token_ids) for p, o in zip(prompts, outs, strict=True)]
        live = list(range(B))  # rows of the batch still generating; finished ones leave the batch
        self.calls += 1
        call = self.calls
        while True:
            clock = StepTimer(STEP_PHASES)
            keep = [j for j, i in enumerate(live) if not (outs[i].finished or len(outs[i].token_ids) >= max_new_tokens)]
            if not keep:
                return outs
            if len(keep) < len(live):
                sel = torch.tensor(keep, device=anchor.device)
                kv.select(sel)
                if ctx is not None:
                    ctx.select(sel)
                anchor, live, bs = anchor[sel], [live[j] for j in keep], bs.select(sel)
                hist = None if hist is None else OutputHistory(hist.counts[sel], hist.length[sel])
                clock.lap("commit", anchor)
            step = _Step(bs, gen, [prompts[i] for i in live], [outs[i] for i in live], [stops[i] for i in live],
                         max_new_tokens, s.acceptance, hist, None if matches is None else [matches[i] for i in live],
                         [(call, i) for i in live])
            n0 = [len(o.token_ids) for o in step.outs]
            cand = None if self.matcher is None else self.matcher.match_only(step.matches, self.gamma, anchor.device)
            if self.draft is not None and self._speculate(len(live), cand, step.keys):
                anchor = self._spec_step(kv, ctx, anchor, step, clock, cand=cand)
            elif (match := self._match_step(step, cand)) is not None:
                anchor = self._spec_step(kv, ctx, anchor, step, clock, match)
            else:
                anchor = self._plain_step(kv, anchor, step, clock, ctx)
            for st, o, n in zip(step.matches or (), step.outs, n0, strict=False):  # the match index sees the text
                st.index.extend(o.token_ids[n:])
            clock.lap("other")
            for k, v in clock.seconds.items():
                self.step_s[k] += v
            self.steps += 1

    def _next_tokens(self, logits, bs, gen, prompts, outs, rows) -> Tensor:
        """The target's own draw for the token after each row's last token (prefill)."""
        positions = torch.tensor([len(prompts[i]) - 1 for i in rows], device=logits.device)
        hist = OutputHistory.from_lists([[] for _ in rows], logits.shape[-1], logits.device) if bs.any_penalty \
            else None
        return next_tokens(logits, bs, hist, step_noise(bs, gen, positions))

    def _speculate(self, batch_size: int, cand: MatchStep | None = None, keys: list | None = None) -> bool:
        """The full-cost planner's decision for this step (earlier steps' data, the rows' requests' rates and the
        rows' matches `cand`, a function of the committed text); other planners always draft."""
        return not isinstance(self.planner, AdaptivePlanner) or \
            self.planner.decide(batch_size, None if cand is None else cand.survival, keys).speculate

    def _match_step(self, step: _Step, cand: MatchStep | None) -> tuple[Choice, int] | None:
        """Where the full-cost rule said off: (the matches' Choice, width) when verifying the rows' matches alone, with
        no draft pass, pays (FullCostRule.match_width); None for a plain step."""
        if cand is None or not isinstance(self.planner, AdaptivePlanner):
            return None
        width = self.planner.rule.match_width(len(step.outs), cand.survival)
        return (cand.choice(self.target.vocab_size), width) if width > 1 else None

    def _plain_step(self, kv, anchor, step: _Step, clock: StepTimer, ctx: DraftContextCache | None = None) -> Tensor:
        """One plain decode step; with a draft context (an "off" step) the anchor's context is appended too."""
        clock.lap("other", anchor)
        out = kv.extend(anchor[:, None], logits="last")
        clock.lap("verify", out.logits)
        nxt = next_tokens(out.logits[:, -1], step.bs, step.history, step.noise(anchor.device))
        clock.lap("accept", nxt)
        if ctx is not None:
            ctx.append(out.aux, torch.ones_like(nxt))
            clock.lap("commit", ctx.lengths)
        dt = clock.seconds["verify"] + clock.seconds["accept"] + clock.seconds["commit"]
        if isinstance(self.planner, AdaptivePlanner):
            self.planner.rule.observe_off(len(nxt), dt)
        for o in step.outs:
            o.stats.verify_s += dt
        self._emit(step.outs, [[int(t)] for t in nxt], step.stops, step.max_new, step.history)
        return nxt

    def _spec_step(self, kv: TargetKV, ctx: DraftContextCache, anchor: Tensor, step: _Step, clock: StepTimer,
                   match: tuple[Choice, int] | None = None, cand: MatchStep | None = None) -> Tensor:
        """A speculative step: draft, choose (the hybrid, against the rows' matches `cand`), schedule, verify, accept,
        commit. `match` (a match step: `_match_step`'s choice and width) skips the draft pass and verifies the rows'
        matches alone."""
        draft, gamma = self.draft, self.gamma
        timer = StepTimer() if self.time_split and match is None else None
        clock.lap("other", anchor)
        noise = step.noise(anchor.device)
        if match is not None:
            choice, width = match
            prop = choice.proposal
            limit = choice.cap.clamp(max=width - 1).to(anchor.device)
            return self._verify_step(kv, ctx, anchor, step, clock, prop, choice, limit, noise, None, drafted=False)
        h = draft.forward_step(anchor, ctx)
        clock.lap("draft", h)
        if timer is not None:
            timer.seconds["backbone"] += clock.seconds["draft"]
        prop = propose(draft, h, anchor, step.bs, noise, timer)
        choice = None
        if self.matcher is not None:
            choice = self.matcher.choose(step.matches, prop, self._confidences(prop), step.bs.greedy,
                                         self.target.vocab_size, cand)
            prop = choice.proposal
        limit = None
        if self.planner is not None:
            from_conf = getattr(self.planner, "from_conf", None)  # the confidence and full-cost planners
            lengths = self.planner(prop) if choice is None or choice.conf is None or from_conf is None \
                else from_conf(choice.conf)  # the width rule sees the chosen proposals' survival
            limit = (lengths - (2 if planted("verify_limit") else 1)).clamp(0, gamma)
        if choice is not None:  # a match row accepts at most its k continuation tokens
            limit = torch.minimum(limit if limit is not None else torch.full_like(choice.cap, gamma),
                                  choice.cap.to(anchor.device))
        return self._verify_step(kv, ctx, anchor, step, clock, prop, choice, limit, noise, timer, drafted=True)

    def _verify_step(self, kv: TargetKV, ctx: DraftContextCache, anchor: Tensor, step: _Step, clock: StepTimer,
                     prop: Proposal, choice: Choice | None, limit: Tensor | None, noise, timer: StepTimer | None,
                     drafted: bool) -> Tensor:
        """Verify `prop` (each row up to `limit` drafts), accept, commit, record, emit; the next anchors. `drafted`:
        False on a match step (its costs price T_after only; its acceptance is the matcher's, not the draft's)."""
        gamma, outs, max_new = self.gamma, step.outs, step.max_new
        n_verify = gamma + 1
        if limit is not None:
            n_verify = int(limit.max()) + 1  # the target runs only the longest scheduled prefix
        clock.lap("rollout", prop.tokens)
        verify_ids = torch.cat((anchor[:, None], prop.tokens[:, : n_verify - 1]), 1)
        out = kv.extend(verify_ids, logits="all")
        clock.lap("verify", out.logits)
        logits = adjust_logits(out.logits, step.bs, step.history, prop.tokens[:, : n_verify - 1])
        res = accept_rows(prop, logits, step.bs, limit, noise, step.acceptance)
        keep = res.num_accepted + 1  # the anchor and the accepted drafts now have target KV
        clock.lap("accept", res.bonus)
        kv.commit(n_verify, torch.full_like(keep, n_verify) if planted("kv_rollback") else keep)
        t2 = _sync_time(keep)
        if planted("context_keep"):  # the context of x_1..x_{c+1} at the places of anchor..x_c
            ctx.append(out.aux, keep.clamp(max=n_verify - 1), start=torch.ones_like(keep))
        else:
            ctx.append(out.aux, keep)
        t3 = _sync_time(ctx.lengths)
        clock.lap("commit")
        if isinstance(self.planner, AdaptivePlanner):
            sec = clock.seconds
            after_s = sec["verify"] + sec["accept"] + sec["commit"]
            if drafted or planted("match_step_stats"):  # planted: a match step's acceptance taken as the draft's
                self.planner.rule.observe_spec(len(keep), n_verify, sec["draft"] + sec["rollout"], after_s,
                                               res.num_accepted,
                                               self.planner.survival_factors(prop) if choice is None else choice.conf,
                                               None if choice is None or not drafted else draft_rows(choice.use_match),
                                               step.keys)
            else:
                self.planner.rule.observe_match(len(keep), n_verify, after_s)
        sec, ctx_s = clock.seconds, t3 - t2  # the draft context's K/V is draft work, the target's KV verify work
        draft_s, verify_s = sec["draft"] + sec["rollout"] + ctx_s, sec["verify"] + sec["accept"] + sec["commit"] - ctx_s
        emitted = []
        if choice is not None:
            self.matcher.record(step.matches, choice, limit.tolist(), res.num_accepted.tolist())
        for b, o in enumerate(outs):
            c = int(res.num_accepted[b])
            if not (o.finished or len(o.token_ids) >= max_new):
                o.stats.accepted.append(c)
                o.stats.verified.append(n_verify - 1 if limit is None else int(limit[b]))
                if choice is not None:
                    o.stats.from_match.append(bool(choice.use_match[b]))
                if prop.conf_logits is not None:
                    o.stats.confidence.append(prop.conf_logits[b].tolist())
                o.stats.draft_s += draft_s
                o.stats.verify_s += verify_s
                if timer is not None:  # the context K/V of the committed tokens is backbone work too
                    for k, v in timer.seconds.items():
                        o.stats.draft_split[k] += v + (ctx_s if k == "backbone" else 0.0)
            emitted.append(prop.tokens[b, :c].tolist() + [int(res.bonus[b])])
        self._emit(outs, emitted, step.stops, max_new, step.history)
        return res.bonus

    def _confidences(self, prop: Proposal) -> Tensor | None:
        """The draft's calibrated confidences [B, γ] (the planner's STS, else the draft's own), None without a head."""
        if prop.conf_logits is None:
            return None
        calibrated = getattr(self.planner, "calibrated", None)
        if calibrated is not None:
            return calibrated(prop.conf_logits)
        from dspark_sgl.speculative.sts import apply_sts

        temps = self.draft.config.sts_temperatures
        return apply_sts(prop.conf_logits.float(), None if temps is None else torch.tensor(temps))

    @staticmethod
    def _emit(outs: list[Generation], tokens: list[list[int]], stops: list[frozenset[int]], max_new: int,
              hist: OutputHistory | None) -> None:
        """Append each row's tokens up to its stop token or max_new (and count them into hist, row for row)."""
        for b, (o, toks, stop) in enumerate(zip(outs, tokens, stops, strict=True)):
            n0 = len(o.token_ids)
            for t in toks:
                if o.finished or len(o.token_ids) >= max_new:
                    break
                o.token_ids.append(t)
                o.finished = t in stop
            if hist is not None and len(o.token_ids) > n0:
                new = torch.tensor(o.token_ids[n0:], device=hist.counts.device)
                hist.counts[b].index_add_(0, new, torch.ones(len(new), device=new.device))
                hist.length[b] += len(new)


@dataclass
class _Step:
    """What one decode step needs to know about the live rows."""

    bs: BatchSampling
    gen: torch.Generator
    prompts: list[list[int]]
    outs: list[Generation]
    stops: list[frozenset[int]]
    max_new: int
    acceptance: str
    history: OutputHistory | None  # output so far, the anchor included (only when some row has a penalty)
    matches: list[MatchState] | None = None  # each row's match index (the hybrid, --match)
    keys: list[tuple[int, int]] | None = None  # each row's request (generate call, row): the rule's per-request rates

    def noise(self, device):
        if self.bs.seeds is None:
            return step_noise(self.bs, self.gen, None)
        positions = torch.tensor([len(p) + len(o.token_ids) - 1 for p, o in zip(self.prompts, self.outs,
                                                                                   strict=True)], device=device)
        return step_noise(self.bs, self.gen, positions)


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


def confidence_planner(target: HFTarget, draft: DSparkDraft, sps_path=None, max_batch: int = 1):
    """The `confidence` schedule: SPS table from sps_path (or profiled now up to max_batch full windows: past the
    table's last count a lookup repeats its last value, which would price a wider verify as free), STS temperatures
    from the draft."""
    from dspark_sgl.speculative.scheduler import ConfidencePlanner
    from dspark_sgl.speculative.sps import SpsTable

    if draft.confidence_head is None:
        raise ValueError("--schedule confidence needs a draft with a confidence head")
    sps = SpsTable.load(sps_path) if sps_path else profile_target_sps(target, max_batch * (draft.config.block_size + 1))
    temps = draft.config.sts_temperatures
    return ConfidencePlanner(sps, None if temps is None else torch.tensor(temps), "confidence")
