"""The DSPARK speculative worker for SGLang (V2 spec-worker schema), built on the shared dspark_sgl core.

One scheduler step, with SGLang owning every KV slot:

    prefill : target extend with aux capture (ids = OUTPUT of decoder layer i) -> draft context K/V at the
              prompt's slots; the target's sampled token is the first anchor
    decode  : decide, from earlier steps only, whether to speculate (the shared full-cost rule; planning.py); if not,
              an "off" step: the width-1 verify below (a plain decode step: capture and context as usual) and the
              target's own draw, no draft. Else:
              draft block [anchor, MASK...] over the context (DSparkDraft.forward_step) -> Markov rollout
              -> verify lengths from the confidence head (the full-cost padded width rule; planning.py)
              -> target TARGET_VERIFY over [anchor, x_1..] in the first w columns of SGLang's pre-allocated window,
                 w = the longest scheduled length in the batch (γ+1 under the static policy)
              -> the shared per-row target distribution and acceptance (dspark_sgl.speculative.rows)
              (under TP, rank 0's drafts + verify lengths and accepted counts + bonus tokens go to every rank: ranks.py)
              -> commit anchor + accepted (target KV, draft context and token ids at the same slots)
              -> emit accepted + bonus; the bonus is the next anchor

The DSpark math (draft forward, rollout, target distribution, acceptance) comes from dspark_sgl.model /
dspark_sgl.speculative; SGLang supplies the verify window, the verify forward, the requests' sampling parameters
(dspark_sgl.sglang.sampling maps them) and the per-request bookkeeping (accept lengths, histograms, /server_info).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_exec, get_parallel, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.dspark_components.dspark_planner import alloc_verify_window
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask
from torch import Tensor

from dspark_sgl.dtypes import dtype_name, resolve_dtype
from dspark_sgl.faults import planted
from dspark_sgl.model.checkpoint import load_draft
from dspark_sgl.sglang.args import override_arg
from dspark_sgl.sglang.context import DraftContextPool
from dspark_sgl.sglang.hybrid import HybridState, is_hybrid
from dspark_sgl.sglang.planning import VerifyPlanner, engine_facts, sps_cache_file
from dspark_sgl.sglang.ranks import tp_rank_sync
from dspark_sgl.sglang.sampling import BatchSamplingCache, SlotTokens
from dspark_sgl.sglang.steptime import StepTimes
from dspark_sgl.sglang.traffic import TrafficRecorder
from dspark_sgl.sglang.weights import DraftRunner, DraftUpdater, Release
from dspark_sgl.speculative.match import Choice, MatchChooser, MatchConfig, MatchState, MatchStep
from dspark_sgl.speculative.rows import accept_rows, plain_tokens, propose, step_noise
from dspark_sgl.speculative.scheduler import Decision
from dspark_sgl.speculative.target_dist import adjust_logits

logger = logging.getLogger(__name__)
DRAFT_DTYPE_KEY = "dspark_draft_dtype"  # in --json-model-override-args; `dspark serve --draft-dtype` sets it
MATCH_KEY = "dspark_match"  # likewise (`dspark serve --match`): the hybrid's default; a request's custom_params may
# carry the same key to switch it for that request alone
SPECULATE_KEY = "dspark_speculate"  # auto | on | off (`dspark serve --speculate`)
SPECULATE_MAX_BATCH_KEY = "dspark_speculate_max_batch"  # larger batches never speculate (`--speculate-max-batch`)


def draft_dtype(target_dtype: torch.dtype, device) -> torch.dtype:
    """The draft's dtype: the target's, unless the override names one (`auto`: bf16 where the hardware multiplies
    it natively). Only the target decides tokens, so the draft's dtype changes speed and acceptance, never output."""
    name = override_arg(DRAFT_DTYPE_KEY)
    return target_dtype if name is None else resolve_dtype(str(name), device, what=DRAFT_DTYPE_KEY)


class DSparkWorker(BaseSpecWorker):
    """Drop-in for SGLang's DSparkWorkerV2: same constructor, same GenerationBatchResult contract."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker, **_unused):
        super().__init__()
        self.server_args = server_args
        self.gpu_id, self.nccl_port = gpu_id, nccl_port
        self._target_worker = target_worker
        self._draft_worker = None  # no SGLang draft runner: the draft is a plain torch module
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        # linear-attention hybrids (K3/Kimi-Linear KDA, GDN, Mamba): recurrent-state commit after verify (hybrid.py)
        self.hybrid = HybridState(self.model_runner) if is_hybrid(self.model_runner) else None
        spec = get_spec()
        self.draft_dtype = draft_dtype(self.model_runner.dtype, self.device)
        self.draft = load_draft(spec.speculative_draft_model_path, device=self.device, dtype=self.draft_dtype)
        self.gamma = self.draft.config.block_size
        self.verify_width = self.gamma + 1
        if int(spec.speculative_num_draft_tokens) != self.verify_width:
            raise ValueError(
                f"speculative_num_draft_tokens={spec.speculative_num_draft_tokens} but the draft's block_size + 1 "
                f"= {self.verify_width}"
            )
        captured = list(self.model_runner.spec_aux_config.dflash_target_layer_ids or [])
        if captured != self.draft.config.target_layer_ids:
            raise ValueError(f"target captures layers {captured}, draft expects {self.draft.config.target_layer_ids}")
        self._bind_target_heads()
        self.block_verification = bool(spec.speculative_use_block_verification)
        self.generator = torch.Generator(device=self.device).manual_seed(int(target_worker.random_seed))
        self.block_pos_offsets = torch.arange(self.verify_width, device=self.device)
        self.on_cpu = torch.device(self.device).type == "cpu"
        self.context: DraftContextPool | None = None  # sized in alloc_memory_pool, once SGLang's pool exists
        self.slot_tokens: SlotTokens | None = None  # likewise: the token id at each KV slot (penalty history)
        ex = get_exec()
        self.sampling = BatchSamplingCache(self.model_runner.model_config.vocab_size, self.device,
                                           ex.kernel.sampling_backend, ex.deterministic.enable_deterministic_inference)
        cache = sps_cache_file(engine_facts(server_args, self.device, self.model_runner.dtype, self.verify_width))
        self.planner = VerifyPlanner.from_server_args(spec, self.draft, cache, override_arg(SPECULATE_KEY),
                                                      override_arg(SPECULATE_MAX_BATCH_KEY))
        self.ranks = tp_rank_sync()  # rank 0's decisions on every TP rank; a no-op at TP=1
        if self.ranks.active:  # every rank starts from rank 0's costs (the decisions are rank 0's anyway)
            self.planner.adopt(self.ranks.share_object(self.planner.state()))
        if self.ranks.active and self.ranks.group.rank_in_group != 0:
            self.planner.save_path = None  # the learnt cost table is written once, by rank 0
            if planted("rank_sync"):  # and share() broadcasts nothing: rank 1+ drafts with another seed
                torch.manual_seed(self.ranks.group.rank_in_group)
                for p in self.draft.parameters():
                    p.data.add_(torch.randn_like(p) * 0.5)
        self.times = StepTimes(self.device, on_step=self.planner.observe_timing)  # step timings price the rule
        self._stale_rows: Tensor | int = 0  # request-steps capped by a stale context, summed on the device
        self._prompts: tuple[tuple, list[int], Tensor] | None = None  # (requests, host, device) prompt lengths
        self._last: tuple[tuple, int, GenerationBatchResult] | None = None  # (requests, width, result) of last step
        self.updates = DraftUpdater(lambda: self.draft, self._install_draft, self._invalidate_context, self.ranks)
        self.traffic = TrafficRecorder.from_server_args()
        self.match_default = bool(override_arg(MATCH_KEY, False)) or self.planner.rule.config.mode == "match"
        self.matcher = MatchChooser(MatchConfig())
        self.match_states: dict[str, MatchState] = {}
        self._match_unsynced = 0  # request-steps whose host text was not at the anchor (verified the draft instead)
        self._match_pending: dict[str, tuple[bool, int, int]] = {}  # rid -> (used the match, key, limit), last step
        self._match_tails: dict[str, list[int] | tuple] = {}  # rid -> its last step's committed tokens (or the result)
        logger.info(
            "dspark-sgl DSparkWorker: block size %d, target layers %s, %s acceptance for sampled requests, "
            "%s verify schedule, draft dtype %s",
            self.gamma,
            self.draft.config.target_layer_ids,
            "block" if self.block_verification else "token-wise rejection",
            self.planner.policy,
            dtype_name(self.draft_dtype),
        )

    def __getattr__(self, name):  # like the builtin: anything else the scheduler asks is the target worker's
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    def _bind_target_heads(self) -> None:
        """Share the target's embedding and lm_head; under TP the head shards are gathered once (untested)."""
        target = self.model_runner.model
        embed = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else target.model.embed_tokens
        weight = target.lm_head.weight
        if get_parallel().tp_size > 1:
            from sglang.srt.distributed import tensor_model_parallel_all_gather

            weight = tensor_model_parallel_all_gather(weight, dim=0)
        weight = weight[: self.draft.config.vocab_size]
        self.draft.bind_target(embed, SimpleNamespace(weight=weight), hot_dtype=self.draft_dtype)

    # ---- hooks the scheduler calls on a DSPARK worker -------------------------------------------------------
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        super().alloc_memory_pool(memory_pool_config, req_to_token_pool, token_to_kv_pool_allocator)
        pool = self.model_runner.token_to_kv_pool
        self.context = DraftContextPool(self.draft, pool.size + pool.page_size, self.device, self.draft_dtype)
        self.slot_tokens = SlotTokens(pool.size + pool.page_size, self.device)

    def dump_info_records(self) -> dict:
        self.updates.record.stale_rows += int(self._stale_rows)  # outside any step: the device count is read here
        self._stale_rows = 0
        info = {**self.planner.info(), "draft_dtype": dtype_name(self.draft_dtype), "step_ms": self.times.info()}
        info["draft_update"] = {**self.updates.record.to_dict(), "context_epoch": self.context.epoch}
        info["pools"] = self.pool_counts()
        info["match"] = {"default": self.match_default, "unsynced_rows": self._match_unsynced,
                         **self.matcher.counters.to_dict()}
        if self.traffic is not None:
            self.traffic.sweep()
            info["traffic"] = self.traffic.info()
        return info

    def pool_counts(self) -> dict:
        """Free and total KV tokens (SGLang's allocator; our draft context and slot tokens live at the same slot ids)
        and request slots (the rows of req_to_token through which the draft context is gathered): once the load has
        drained and the radix cache is flushed, both free counts must be back at their idle values, or a slot leaked
        (benchmarks/soak.py checks it)."""
        alloc, reqs = self.model_runner.token_to_kv_pool_allocator, self.model_runner.req_to_token_pool
        return {"kv_free_tokens": int(alloc.available_size()), "kv_tokens": int(alloc.size),
                "context_slots": self.context.num_slots, "req_slots_free": int(reqs.available_size()),
                "req_slots": int(reqs.size)}

    def clear_info_records(self) -> None:
        self.planner.clear()
        self.times.clear()
        self.matcher.counters.clear()

    # ---- the hybrid: a match from the request's own text (speculative/match.py) ---------------------------------
    def _match_on(self, req) -> bool:
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        return bool(custom.get(MATCH_KEY, self.match_default))

    def _match_states(self, reqs, lens_cpu) -> list[MatchState | None] | None:
        """Each request's match index, caught up with its text through this step's anchor, and its last step's outcome
        recorded; None for a row whose text could not be completed (it verifies the draft), or for every row when no
        request asks for the match. SGLang appends a step's tokens to req.output_ids only after the next step has
        run, so the text is the host's origin_input_ids + output_ids followed by the tokens this worker committed in
        the request's last step (`_match_keep_tails`); only the tokens past what the index holds are read."""
        on = [self._match_on(r) for r in reqs]
        if not any(on):
            return None
        states, seen = [], {}
        for r, use, n_kv in zip(reqs, on, lens_cpu.tolist(), strict=True):
            st = self.match_states.get(r.rid) or self.matcher.new_state()
            seen[r.rid] = st
            tail = self._match_tail(r.rid)
            last = self._match_pending.pop(r.rid, None)
            if last is not None and tail:
                self.matcher.record_one(st, *last, len(tail) - 1)  # the last step committed c + 1 tokens
            text = n_kv + 1  # tokens through the anchor (which has no KV yet)
            prompt, out = r.origin_input_ids, r.output_ids
            host, tail_at = len(prompt) + len(out), text - len(tail or ())
            if host >= tail_at and len(st.index) <= text:
                st.index.extend([prompt[i] if i < len(prompt) else out[i - len(prompt)]
                                 for i in range(len(st.index), min(host, text))])
                st.index.extend((tail or [])[max(len(st.index), host) - tail_at:])
            synced = len(st.index) == text
            if use and not synced:
                if self._match_unsynced < 3:
                    logger.warning("dspark-sgl match: request %s text %d tokens on the host + %d of its last step, KV "
                                   "%d: the anchor is not known, verifying the draft", r.rid, host, len(tail or ()),
                                   n_kv)
                self._match_unsynced += 1
            states.append(st if use and synced else None)
        self.match_states = seen  # requests that left the batch drop their index (rebuilt if they come back)
        self._match_tails = {rid: self._match_tails[rid] for rid in seen if rid in self._match_tails}
        return states

    def _match_tail(self, rid: str) -> list[int] | None:
        """The tokens the request's last step committed (accepted drafts + bonus; after prefill, its first token)."""
        src = self._match_tails.get(rid)
        if src is None or isinstance(src, list):
            return src
        result, row, stride = src  # an accelerator: read SGLang's host copy of the result once it is done
        if result.copy_done is not None and not result.copy_done.query():
            return None
        ids, acc = result.next_token_ids, result.accept_lens
        if ids.device.type != "cpu" or (acc is not None and acc.device.type != "cpu"):
            return None
        return ids[row * stride : row * stride + (1 if acc is None or stride == 1 else int(acc[row]))].tolist()

    def _match_keep_tails(self, reqs, result, stride: int) -> None:
        """After a step: where each request's committed tokens are. On a CPU they are host memory and read now (no
        sync); elsewhere the result is kept and read from its host copy at the request's next step."""
        if not any(self._match_on(r) for r in reqs) or result.next_token_ids.numel() != len(reqs) * stride:
            return
        if not self.on_cpu:
            for b, r in enumerate(reqs):
                self._match_tails[r.rid] = (result, b, stride)
            return
        ids = result.next_token_ids.tolist()
        acc = [1] * len(reqs) if result.accept_lens is None or stride == 1 else result.accept_lens.tolist()
        for b, r in enumerate(reqs):
            self._match_tails[r.rid] = ids[b * stride : b * stride + acc[b]]

    def _choose(self, states, cand, prop, rows):
        """The hybrid's choice for this step, or (prop, None) when it is off for every row."""
        if states is None:
            return prop, None
        conf = None if prop.conf_logits is None else self.planner.calibrated(prop.conf_logits)
        choice = self.matcher.choose(states, prop, conf, rows.greedy.cpu(), self.model_runner.model_config.vocab_size,
                                     cand)
        return choice.proposal, choice

    def _match_record(self, reqs, choice, width: int) -> None:
        """Remember each row's source for the next step, which reads its accepted count from the host text."""
        for r, use, key, cap in zip(reqs, choice.use_match.tolist(), choice.key.tolist(), choice.cap.tolist(),
                                    strict=True):
            self._match_pending[r.rid] = (use, key, min(cap, width - 1))

    def block_accept_estimate_log_suffix(self):
        return None

    def set_dspark_forced_budget_frac(self, frac) -> None:
        """SGLang's run-time switch (/set_internal_state dspark_force_budget_frac, admin-key protected when the server
        has one; numbers in (0, 1]): 1 = the full-cost rule decides; f < 1 = speculate on every step at width
        <= ceil(f (γ+1)); a width of 1 = off on every step."""
        self.planner.set_forced_fraction(frac)

    def get_confidence_budget_prepare(self):
        return None

    # ---- live draft updates and traffic recording (weights.py, traffic.py) -----------------------------------
    def weight_update_runners(self) -> list:
        """SGLang's selector `draft` / `all` reaches our draft through this runner (the builtin returns its own)."""
        return [("draft", DraftRunner(self.updates))]

    def _install_draft(self, release: Release) -> None:
        """Between scheduler steps: the new draft serves the next step whole; older context is marked stale."""
        self.draft = release.draft
        self.context.new_epoch(release.draft)
        self.planner.use_release(release.sts, release.sps)

    def _invalidate_context(self) -> None:
        self.context.new_epoch(self.draft)

    def _cap_stale(self, lengths, stale):
        """Requests whose context predates the last swap verify the anchor alone (plain decoding)."""
        if stale is None:
            return lengths
        self._stale_rows = self._stale_rows + stale.sum()
        if planted("stale_cap"):
            return lengths
        return torch.where(stale, torch.ones_like(lengths), lengths)

    def _host_width(self, key: tuple) -> int:
        """The verify width of a confidence-scheduled step, chosen on the host before this step's lengths exist.

        Reading max(lengths) would be a device->host sync, so the width comes from the previous step of the same
        requests instead, through the verify lengths it returned as `cap_lens`, which SGLang has already copied to
        the host (GenerationBatchResult.copy_to_cpu) by the time the next step starts: the longest of them, or the
        full window when the last width capped someone (or nothing is known yet: new requests, copy not done).
        This step's lengths are then capped at that width, which depends only on earlier steps, never on this
        step's draft tokens, so acceptance stays exact."""
        W = self.verify_width
        if self._last is None or self._last[0] != key:
            return W
        _, width, result = self._last
        done = result.copy_done
        if result.cap_lens is None or result.cap_lens.device.type != "cpu":
            return W
        if done is not None and not done.query():
            if not self.ranks.active:
                return W
            done.synchronize()  # under TP every rank must choose the same width: wait rather than race the copy
        longest = int(result.cap_lens.max())
        return W if longest >= width else longest + 1

    # ---- one scheduler step ---------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, *, pp_proxy_tensors=None):
        if self.traffic is not None:
            self.traffic.observe(batch.reqs)
        if batch.forward_mode.is_idle():
            return self._idle_result(on_publish)
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._forward_prefill(batch, on_publish)
        return self._forward_decode(batch, on_publish, grammar_barrier)

    @torch.no_grad()
    def _forward_prefill(self, batch, on_publish) -> GenerationBatchResult:
        slots = batch.out_cache_loc.clone()  # read before the forward: the radix cache may move it afterwards
        ids = batch.input_ids.clone()
        spans = zip(batch.prefix_lens, batch.extend_lens, strict=True)
        positions = torch.cat([torch.arange(p, p + n, device=self.device) for p, n in spans])
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        aux = out.logits_output.hidden_states
        if aux is None or aux.shape[0] != slots.shape[0]:
            raise RuntimeError(f"target returned no aux hidden states for the {slots.shape[0]} prefill tokens")
        self.context.write(slots, aux, positions)
        self.slot_tokens.write(slots, ids)
        out.logits_output.hidden_states = None  # never copied to the host
        out.new_seq_lens = batch.seq_lens
        out.next_draft_input = make_draft_input_v2(bonus_tokens=out.next_token_ids, new_seq_lens=batch.seq_lens)
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        self._match_keep_tails(batch.reqs, out, 1)
        return out

    @torch.no_grad()
    def _forward_decode(self, batch, on_publish, grammar_barrier=None) -> GenerationBatchResult:
        """decide -> [draft -> rollout -> width] -> verify -> accept -> commit. An off step (the rule's "no") verifies
        the anchor alone (a width-1 verify is a plain decode step: SGLang's window, capture and KV slots as usual)
        and draws the next token from the target's distribution exactly as plain decoding does. A match step (the
        rule's "no", but the hybrid's matches from the text pay without a draft pass) verifies those alone."""
        draft_input: DFlashDraftInputV2 = batch.spec_info
        bs, W = len(batch.seq_lens), self.verify_width
        self.times.start(batch_size=bs)
        seq_lens = batch.seq_lens.long()
        anchor = draft_input.bonus_tokens.view(-1).long()
        rows = self.sampling.get(batch.reqs)
        noise = step_noise(rows, self.generator, seq_lens)  # seeded requests: a stream of (seed, anchor position)
        lens_cpu = batch.seq_lens_cpu  # host-side: widths and budgets come from here, never from device tensors
        longest = int(lens_cpu.max()) if lens_cpu is not None else None

        states = None if lens_cpu is None else self._match_states(batch.reqs, lens_cpu)  # the hybrid's, or None
        cand = None if states is None else self.matcher.match_only(states, self.gamma, self.device)
        rids = [r.rid for r in batch.reqs]  # the rule's per-request acceptance keys
        decision = self._decide(bs, cand, rids)  # earlier steps' data and the committed text: lossless
        match = None if decision.speculate else self._match_step(bs, decision, cand)
        self.times.mark("decide")
        choice = None
        if decision.speculate:
            prop, lengths, w, choice = self._draft(batch, anchor, rows, noise, seq_lens, longest, states, cand)
            drafts = prop.tokens
        elif match is not None:  # a match step: the rows' matches alone, no draft pass (a row without one: its anchor)
            choice, w, decision = match
            prop = choice.proposal
            lengths = choice.cap.clamp(max=w - 1).to(self.device) + 1
            prop.tokens, lengths = self.ranks.share(prop.tokens, lengths)
            drafts = prop.tokens
        else:
            prop, lengths, w = None, torch.ones(bs, dtype=torch.long, device=self.device), 1
            drafts = anchor.new_zeros(bs, W - 1)
            for r in batch.reqs:  # an off step's token is not a proposal's outcome
                self._match_pending.pop(r.rid, None)
        self.times.note(speculate=decision.speculate, width=w, match=decision.why == "match",
                        forced=self.planner.forced_width is not None)  # the profile's arms, the run-time switch
        verify_ids = torch.cat((anchor[:, None], drafts), 1)
        window = self._window(batch, draft_input, w)
        self.times.mark("schedule")
        logits_output, can_run_graph = self._verify(batch, draft_input, window, verify_ids[:, :w])
        if batch.has_grammar:
            self._grammar_mask(batch, logits_output, verify_ids[:, :w], grammar_barrier)
        self.times.mark("verify")
        logits = self._target_logits(batch, rows, logits_output, drafts[:, : w - 1], anchor, seq_lens, longest)
        if prop is None:
            c, bonus = torch.zeros_like(anchor), plain_tokens(logits[:, 0], rows, noise)
            c, bonus = self.ranks.share(c, bonus)
        else:
            rule = "block" if self.block_verification else "rejection"
            limit = (lengths - 2).clamp(min=0) if planted("verify_limit") else lengths - 1
            if choice is not None:  # a match row accepts at most its k continuation tokens
                limit = torch.minimum(limit, choice.cap.to(limit.device))
                self._match_record(batch.reqs, choice, w)
            acc = accept_rows(prop, logits, rows, limit, noise, rule)
            c, bonus = self.ranks.share(acc.num_accepted, acc.bonus)  # and commits what rank 0 accepted
            self.planner.record(lengths, w, c, decision, prop.conf_logits, None if choice is None else choice.conf,
                                None if choice is None else choice.use_match, rids)
        self.planner.record_step(bs, decision, w)
        self.times.mark("accept")
        return self._commit(batch, on_publish, logits_output, can_run_graph, window, verify_ids, drafts, lengths, w,
                            c, bonus, seq_lens)

    def _decide(self, bs: int, cand: MatchStep | None, rids: list):
        """Speculate this step? The full-cost rule from earlier steps and, with the hybrid, the rows' matches (or the
        operator's switch); under TP rank 0's answer on every rank (each rank's step timings differ, so each would
        decide otherwise)."""
        decision = self.planner.decide(bs, None if cand is None else cand.survival, rids)
        if self.ranks.active:
            flag = torch.tensor([[int(decision.speculate)]], dtype=torch.long, device=self.device)
            decision.speculate = bool(self.ranks.share(flag)[0])
        return decision

    def _match_step(self, bs: int, decision: Decision, cand: MatchStep | None) -> tuple[Choice, int, Decision] | None:
        """Where the rule said off: (the rows' matches from their own text, the width, the step's Decision) when a
        step that verifies them alone, with no draft pass, pays by the full-cost rule (FullCostRule.match_width);
        None for an off step (or when no request asked for the hybrid). Under TP rank 0's width (each rank prices
        with its own timings; the matches are the same text's on every rank)."""
        if cand is None or not self.planner.match_allowed(decision):
            return None
        w = self.planner.rule.match_width(bs, cand.survival)
        if self.ranks.active:
            w = int(self.ranks.share(torch.tensor([[w]], dtype=torch.long, device=self.device))[0])
        if w <= 1:
            return None
        expected = 1.0 + float(cand.survival[:, : w - 1].sum(1).mean())
        return cand.choice(self.model_runner.model_config.vocab_size), w, Decision(True, "match", expected)

    def _draft(self, batch, anchor: Tensor, rows, noise, seq_lens: Tensor, longest: int | None,
               states: list[MatchState | None] | None = None, cand: MatchStep | None = None):
        """Draft block -> rollout -> [the hybrid's choice against the rows' matches `cand`] -> verify lengths and the
        step's width (every rank verifies rank 0's drafts)."""
        bs = len(anchor)
        ctx = self.context.gather(self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens, longest)
        h = self.draft.forward_step(anchor, ctx)
        self.times.mark("draft")
        prop = propose(self.draft, h, anchor, rows, noise)
        prop, choice = self._choose(states, cand, prop, rows)
        self.times.mark("rollout")
        if choice is not None and choice.conf is not None:  # the width rule sees the chosen proposals' survival
            lengths = self.planner.lengths_from_conf(choice.conf, bs, self.device)
        else:
            lengths = self.planner.verify_lengths(prop.conf_logits, bs, self.device)
        w = self.planner.host_width(prop.conf_logits)  # known on the host without reading lengths, or None
        if w is None and not self.on_cpu:  # on a CPU this step's own width is read below: host memory, no sync
            w = self._host_width(tuple(r.rid for r in batch.reqs))
            lengths = lengths.clamp(max=w)
        lengths = self._cap_stale(lengths, ctx.stale)
        prop.tokens, lengths = self.ranks.share(prop.tokens, lengths)
        if w is None:
            w = int(lengths.max())
        return prop, lengths, w, choice

    def _commit(self, batch, on_publish, logits_output, can_run_graph, window, verify_ids: Tensor, drafts: Tensor,
                lengths: Tensor, w: int, c: Tensor, bonus: Tensor, seq_lens: Tensor) -> GenerationBatchResult:
        """Commit the anchor + the c accepted drafts (target KV, draft context and token ids at the same slots) and
        emit them + the bonus; the bonus is the next anchor."""
        bs, W = len(seq_lens), self.verify_width
        if self.hybrid is not None:  # before any other target forward: the commit reads this verify's metadata
            self.hybrid.commit(batch, seq_lens, (c + 2).clamp(max=w) if planted("hybrid_commit") else c + 1)
        cols = torch.arange(W, device=self.device)[None]
        out_tokens = torch.where(cols < c[:, None], torch.cat((drafts, drafts[:, :1]), 1), 0)
        out_tokens.scatter_(1, c[:, None], bonus[:, None])
        keep = (cols[:, :w] <= c[:, None]).reshape(-1)  # the anchor and the accepted drafts now hold target KV
        if planted("context_keep"):  # shifted by one: x_1..x_{c+1}, not the anchor..x_c
            keep = ((cols[:, :w] >= 1) & (cols[:, :w] <= c[:, None] + 1)).reshape(-1)
        aux = logits_output.hidden_states.view(bs * w, -1)
        loc = window.verify_cache_loc_2d.reshape(-1)
        self.context.write(loc, aux, window.positions_2d.reshape(-1), keep)
        self.slot_tokens.write(loc, verify_ids[:, :w].reshape(-1), keep)
        logits_output.hidden_states = None

        if batch.return_logprob:  # the committed tokens all lie in the verified columns: chain layout at width w
            compute_spec_logprobs(batch, logits_output, out_tokens[:, :w].reshape(-1), chain_stride=w)
        new_seq_lens = seq_lens + c + 1
        self.times.mark("commit")
        if on_publish is not None:
            on_publish(new_seq_lens)
        accept_lens = (c + 1).to(torch.int32)
        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=accept_lens,
            # SGLang's spec_cap_length / spec_block_accept_length gauges (and per-request cap histograms): the
            # verify length each request was scheduled, and the tokens its block committed
            cap_lens=lengths.to(torch.int32),
            block_accept_lens=accept_lens,
            can_run_cuda_graph=can_run_graph,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=W,
            new_seq_lens=new_seq_lens,
        )
        self._last = (tuple(r.rid for r in batch.reqs), w, result)
        self._match_keep_tails(batch.reqs, result, W)
        return result

    def _window(self, batch, draft_input, width: int):
        """The first `width` columns of the verify window SGLang pre-allocated for this step (γ+1 slots each)."""
        return alloc_verify_window(
            batch=batch,
            bs=len(batch.seq_lens),
            device=self.device,
            verify_num_draft_tokens=width,
            block_pos_offsets=self.block_pos_offsets[:width],
            model_runner=self.model_runner,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
        )

    def _verify(self, batch, draft_input, window, verify_ids: Tensor):
        """SGLang's TARGET_VERIFY forward over verify_ids [bs, W] = [anchor, drafts] at the window's slots."""
        W = verify_ids.shape[1]
        verify_input = DFlashVerifyInput(
            draft_token=verify_ids.reshape(-1),
            positions=window.positions_2d.reshape(-1),
            draft_token_num=W,
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            live_seq_lens_cpu=batch.seq_lens_cpu,
            kv_loc_plan=window.kv_loc_plan,
        )
        batch.out_cache_loc = window.verify_cache_loc
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        if batch.seq_lens_cpu is not None:  # attention reads seq lens that include the verify window
            batch.seq_lens_cpu = batch.seq_lens_cpu + W
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            batch.seq_lens_cpu, batch.seq_lens_sum = draft_input.nxt_kv_lens_cpu, int(draft_input.nxt_kv_lens_sum)
        forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved
        out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=True
        )
        return out.logits_output, out.can_run_cuda_graph

    def _grammar_mask(self, batch, logits_output, verify_ids: Tensor, barrier) -> None:
        """Grammar-constrained requests (JSON schema, regex, EBNF): the target's verify logits masked by each
        request's grammar along its chain [anchor, x1..x_{w-1}] (SGLang's own traversal, as its builtin DSPARK does),
        so every later step (acceptance, the bonus draw, returned logprobs) reads the constrained distribution. A
        draft token the grammar forbids has probability 0 there and is rejected: lossless at every temperature,
        whatever the draft proposed. SGLang's result processor advances each grammar over the committed tokens."""
        if planted("grammar_mask"):  # the target's unconstrained distribution
            return
        mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=GrammarTree.from_linear_chain(verify_ids),
                                        sampling_info=batch.sampling_info,
                                        device=logits_output.next_token_logits.device, barrier=barrier)
        if mask is not None:
            mask.apply(logits_output.next_token_logits)

    def _target_logits(self, batch, rows, logits_output, drafts: Tensor, anchor: Tensor, seq_lens: Tensor,
                       longest: int | None) -> Tensor:
        """The verify logits [bs, w, V] with the shared per-request adjustments (penalties on each request's output
        so far plus the earlier drafts of the block, logit bias); written back so returned logprobs see them too."""
        bs = len(seq_lens)
        raw = logits_output.next_token_logits
        history = None
        if rows.any_penalty:
            prompt, prompt_lens = self._prompt_lens(batch.reqs)
            if longest is None:  # no host-side lengths: read them (a sync)
                longest = int(seq_lens.max())
            history = self.slot_tokens.history(self.req_to_token_pool.req_to_token, batch.req_pool_indices,
                                               prompt_lens, seq_lens, longest - min(prompt), anchor, raw.shape[-1])
        logits = adjust_logits(raw.view(bs, -1, raw.shape[-1]), rows, history, drafts)
        if rows.any_penalty or rows.logit_bias is not None:
            raw.copy_(logits.view_as(raw))
        return logits

    def _prompt_lens(self, reqs) -> tuple[list[int], Tensor]:
        """Prompt lengths on the host and the device, copied to the device only when the requests change."""
        key = tuple(r.rid for r in reqs)
        if self._prompts is None or self._prompts[0] != key:
            prompt = [len(r.origin_input_ids) for r in reqs]
            self._prompts = (key, prompt, torch.tensor(prompt, device=self.device))
        return self._prompts[1], self._prompts[2]

    def _idle_result(self, on_publish) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=empty,
            accept_lens=empty.to(torch.int32),
            can_run_cuda_graph=False,
            next_draft_input=make_draft_input_v2(bonus_tokens=empty, new_seq_lens=empty),
            speculative_num_draft_tokens=self.verify_width,
            new_seq_lens=empty,
        )
