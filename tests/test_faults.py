"""Planted bugs in the reference engine (dspark_sgl/faults.py): each check below passes on the real code and FAILS
under its planted bug, so the suite is shown to catch that bug. Also the switch itself (registry, unknown name).

Each check is one function returning (passed, detail); the test runs it without and with the plant. The sampled
ones are chi-square tests against an enumeration that does not share the planted code (the penalty reference
passes no drafts; the top-p reference is sampling.target_probs, not target_dist._filter), with the sample counts
that benchmarks/planted_power.py showed give power ~1 (benchmarks/results/planted_power.json).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dspark_sgl.faults import ENV, PLANTS, plant, planted
from dspark_sgl.model import DSparkDraft
from dspark_sgl.model.draft import DraftContextCache
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.markov import rollout
from dspark_sgl.speculative.target_dist import RequestSampling
from dspark_sgl.targets import HFTarget
from dspark_sgl.targets.hf import TargetKV
from tests.conftest import draft_config_for, tiny_llama, tiny_with_random_draft
from tests.test_draft_vocab import reduced
from tests.test_engine import PROMPTS, bigram_draft, chain_accepts, pairs_from
from tests.test_fullcost_rule import (
    alternating,
    check_a_warm_up_step_prices_nothing,
    check_acceptance_memory_in_rows,
    check_cold_steps_stay_narrow,
    check_costs_are_ordered,
    check_decided_before_drafting,
    check_off_where_the_draft_cannot_pay,
    check_requests_rates,
    check_steps_stay_within_the_bound,
    check_the_bound_reads_served_steps_only,
    check_the_draft_is_learnt_before_it_is_priced,
)
from tests.test_match import (
    check_match_rows_stay_out_of_the_draft_statistics,
    check_match_steps_skip_the_draft,
    check_the_rule_weighs_the_matches,
    hybrid_pvalue,
)
from tests.test_model import check_anchor_state_train_equals_step
from tests.test_sampling import chi2_pvalue, exact_three_token_distribution

pytestmark = pytest.mark.planted

ALPHA = 1e-3  # the served-distribution tests' threshold: p below it fails
V3, PROMPT3 = 6, [1, 2, 3]  # the tiny-vocabulary target of the chi-square tests (V^3 = 216 cells)
N_PENALTY, N_TOP_P, N_D2T = 4_000, 4_000, 4_000
# strong penalties: the planted bug's effect grows with them (at test_target_dist's milder set, 4,000 samples catch
# it rarely; benchmarks/results/planted_power.json)
PENALTIES = dict(repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0)


# ---- the switch ------------------------------------------------------------------------------------------------
def test_no_plant_is_active_by_default_and_plant_switches_one_on():
    assert not any(planted(n) for n in PLANTS)
    with plant("seed"):
        assert planted("seed") and not planted("markov_prev")
    assert not planted("seed")


def test_an_unknown_name_is_one_clear_error():
    with pytest.raises(ValueError, match="'nope' is not a known planted bug; known: accept_cold, .*context_keep"):
        with plant("nope"):
            pass
    env = dict(os.environ, **{ENV: "nope"})
    res = subprocess.run([sys.executable, "-c", "import dspark_sgl.faults"], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and f"{ENV}='nope' is not a known planted bug" in res.stderr


def test_the_env_var_is_read_at_import():
    env = dict(os.environ, **{ENV: "top_p_boundary"})
    code = "from dspark_sgl.faults import planted; print(planted('top_p_boundary'), planted('seed'))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["True", "False"]


# ---- the checks ------------------------------------------------------------------------------------------------
def tiny3():
    """V = 6 target and a random draft (weights N(0, 0.5)): drafts often accepted, often rejected."""
    return tiny_with_random_draft(V3)


def three_token_counts(out) -> torch.Tensor:
    seqs = torch.tensor([o.token_ids for o in out])
    return torch.bincount(seqs[:, 0] * V3 * V3 + seqs[:, 1] * V3 + seqs[:, 2], minlength=V3**3)


def penalty_pvalue(n: int = N_PENALTY, seed: int = 7, penalties: dict | None = None) -> float:
    """Served joint of 3 tokens under repetition + frequency + presence penalties vs the enumeration (whose
    history is the output so far: no draft tokens enter it)."""
    from tests.test_target_dist import exact_joint

    model, target, draft = tiny3()
    req = RequestSampling(temperature=1.0, **(penalties or PENALTIES))
    exact = exact_joint(model, req)  # planted code is not on this path (drafts=None)
    out = SpecEngine(target, draft).generate([PROMPT3] * n, 3, SamplingConfig(seed=seed), requests=[req] * n)
    return chi2_pvalue(three_token_counts(out), exact)


def top_p_pvalue(n: int = N_TOP_P, seed: int = 7, top_p: float = 0.8) -> float:
    """Served joint of 3 tokens under top-p vs the independent nucleus of sampling.target_probs."""
    model, target, draft = tiny3()
    exact = exact_three_token_distribution(model, PROMPT3, 1.0, top_p, V3)
    out = SpecEngine(target, draft).generate([PROMPT3] * n, 3, SamplingConfig(temperature=1.0, top_p=top_p, seed=seed))
    return chi2_pvalue(three_token_counts(out), exact)


def d2t_pvalue(n: int = N_D2T, seed: int = 7) -> float:
    """A sampled reduced-vocabulary draft (K = 2 of 6) keeps the target's distribution."""
    model = tiny_llama(vocab=V3, hidden=16, layers=2, seed=3, embed_std=2.0)
    target = HFTarget(model, [0, 1])
    torch.manual_seed(0)
    draft = reduced(target, [1, 4], block_size=3, markov_rank=4)
    with torch.no_grad():
        for prm in draft.parameters():
            prm.normal_(0, 0.5)
    exact = exact_three_token_distribution(model, PROMPT3, 1.0, 1.0, V3)
    out = SpecEngine(target, draft).generate([PROMPT3] * n, 3, SamplingConfig(temperature=1.0, seed=seed))
    return chi2_pvalue(three_token_counts(out), exact)


def check_chi2(fn):
    p = fn()
    return p > ALPHA, f"p = {p:.3g}"


def check_lossless_t0():
    """T = 0: a random draft's output is token-identical to plain greedy decoding."""
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 20)
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=4))
    out = SpecEngine(target, draft).generate(PROMPTS, 20)
    same = [o.token_ids == r.token_ids for o, r in zip(out, ref, strict=True)]
    return all(same), f"identical {sum(same)}/{len(same)}"


def check_bigram_accepts(schedule_all: bool = False):
    """A bigram-oracle draft's per-step accepted counts equal the chain it must draft (all steps but the last,
    which max_new_tokens may cut). schedule_all: under a planner that schedules every draft (γ+1), which must act
    exactly like no planner."""
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 24)
    gamma = 5
    pairs = pairs_from(PROMPTS, [r.token_ids for r in ref])
    draft = bigram_draft(DSparkDraft(draft_config_for(target, block_size=gamma, markov_rank=64)), pairs)
    table = dict(pairs)  # bigram_draft keeps the last successor of each previous token, as dict() does
    planner = (lambda prop: torch.full((prop.tokens.shape[0],), gamma + 1)) if schedule_all else None
    out = SpecEngine(target, draft, planner).generate(PROMPTS, 24)
    got = [o.stats.accepted[:-1] for o in out]
    want = [chain_accepts(table, r.token_ids, gamma)[: len(g)] for r, g in zip(ref, got, strict=True)]
    full = sum(c == gamma for g in got for c in g)
    return got == want and full > 0, f"match {got == want}, full blocks {full}"


@torch.no_grad()
def check_context_from_scratch(planner=None, off_after_each: bool = False):
    """The draft's confidence logits at every engine step equal a recomputation whose draft context is built from
    scratch (a fresh prefill of the committed tokens): the incremental context K/V holds exactly the committed
    tokens at their positions. `off_after_each`: the planner runs an off step first and after every speculative step
    (tests/test_fullcost_rule.py's alternating planner), whose context must be written too."""
    target = HFTarget(tiny_llama(), [0, 2])
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=4))
    prompt = PROMPTS[0]
    o = SpecEngine(target, draft, planner).generate([prompt], 16)[0]
    worst, i = 0.0, int(off_after_each)
    for c, conf in zip(o.stats.accepted, o.stats.confidence, strict=True):
        kv = TargetKV(target, [prompt + o.token_ids[:i]])
        first = kv.prefill(logits="last")
        ctx = DraftContextCache(draft, 1, target.device, draft.fc.weight.dtype)
        ctx.append(first.aux, kv.lengths, start=kv.pad)
        h = draft.forward_step(torch.tensor([o.token_ids[i]]), ctx)
        ref = rollout(draft, h, torch.tensor([o.token_ids[i]])).conf_logits[0]
        worst = max(worst, float((ref - torch.tensor(conf)).abs().max()))
        i += c + 1 + int(off_after_each)
    return worst < 1e-4 and len(o.stats.accepted) >= 3, f"max |Δ confidence logit| = {worst:.3g}"


def test_off_steps_keep_the_draft_context_exact():
    """The full-cost rule's off steps (engine._plain_step with a draft context) append the anchor's context: after
    them the draft's confidences equal a recomputation from scratch (without the append: max Δ 1.4e-3)."""
    ok, detail = check_context_from_scratch(alternating(4, 1), off_after_each=True)
    assert ok, detail


def check_seed():
    """A seeded request gives the same output alone and in a batch run with another generator seed."""
    _, target, draft = tiny3()
    seeded = RequestSampling(temperature=1.0, sampling_seed=1234)
    engine = SpecEngine(target, draft)
    alone = engine.generate([PROMPT3], 12, SamplingConfig(seed=1), requests=[seeded])[0].token_ids
    other = RequestSampling(temperature=0.9)
    mixed = engine.generate([[4, 5], PROMPT3], 12, SamplingConfig(seed=2), requests=[other, seeded])[1].token_ids
    return mixed == alone, f"alone {alone} vs batch {mixed}"


ENGINE_CHECKS = {
    "verify_limit": lambda: check_bigram_accepts(schedule_all=True),
    "context_keep": check_context_from_scratch,
    "d2t_sampled": lambda: check_chi2(d2t_pvalue),
    "markov_prev": check_bigram_accepts,
    "kv_rollback": check_lossless_t0,
    "penalty_drafts": lambda: check_chi2(penalty_pvalue),
    "top_p_boundary": lambda: check_chi2(top_p_pvalue),
    "seed": check_seed,
    "match_residual": lambda: check_chi2(lambda: hybrid_pvalue()[0]),  # the hybrid's served joint, 2,000 samples
    "cost_no_draft": check_off_where_the_draft_cannot_pay,
    "decide_peek": check_decided_before_drafting,
    "match_step_stats": check_match_steps_skip_the_draft,
    "anchor_last": check_anchor_state_train_equals_step,
    "accept_per_step": check_acceptance_memory_in_rows,
    "match_rows_stats": check_match_rows_stay_out_of_the_draft_statistics,
    "match_blind_decide": check_the_rule_weighs_the_matches,
    "cost_unordered": check_costs_are_ordered,
    "request_blind": check_requests_rates,
    "step_uncapped": check_steps_stay_within_the_bound,
    "accept_cold": check_the_draft_is_learnt_before_it_is_priced,
    "forced_typical": check_the_bound_reads_served_steps_only,
    "warmup_priced": check_a_warm_up_step_prices_nothing,
    "cold_wide": check_cold_steps_stay_narrow,
}
# tests/test_sglang_planted.py; rank_sync and rank_agree: tests/test_rank_sync.py (two gloo ranks)
# grammar_mask: tests/test_sglang_server.py::test_planted_unmasked_grammar_is_caught (the engine has no grammars)
WORKER_ONLY = {"hybrid_commit", "hybrid_state", "stale_cap", "rank_sync", "rank_agree", "grammar_mask"}
# export_transpose, export_d2t: tests/test_vllm_interop.py (vLLM's own loader and draft step against ours)
EXPORT_ONLY = {"export_transpose", "export_d2t"}


def test_every_plant_has_a_check():
    assert set(ENGINE_CHECKS) | WORKER_ONLY | EXPORT_ONLY == PLANTS


@pytest.mark.parametrize("name", sorted(ENGINE_CHECKS))
def test_the_check_passes_and_fails_under_the_planted_bug(name):
    ok, detail = ENGINE_CHECKS[name]()
    assert ok, f"clean code: {detail}"
    with plant(name):
        bad, detail_planted = ENGINE_CHECKS[name]()
    assert not bad, f"{name} planted and the check still passes: {detail_planted}"
    print(f"{name}: clean {detail}; planted {detail_planted}")
