"""The match proposer and the hybrid step (dspark_sgl/speculative/match.py).

- MatchIndex, fed token by token, equals a brute-force search of the whole text at every step (random texts over a
  small alphabet: many repeats), with eviction (small windows) and min_n > 1; its memory stays bounded.
- A one-hot q through the shared acceptance rules: the first emitted token ~ p (accept x w.p. p(x), else p without x).
- The reference engine with the hybrid: token-identical to plain decoding at T = 0, and its served joint distribution
  of three tokens equals the enumeration (chi-square) under rejection and block verification, top-p, and a reduced
  draft vocabulary. tests/test_faults.py plants `match_residual` (the residual keeps x) and shows the chi-square fail.
- Match steps: where the full-cost rule is off for the draft, the matches alone are verified with no draft pass
  (FullCostRule.match_width): T = 0 identical, the served joint equal to the enumeration, no draft forward on them,
  and their acceptance kept out of the draft's statistics (tests/test_faults.py plants `match_step_stats`).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from dspark_sgl.kernels.accept_reference import ACCEPT_RULES
from dspark_sgl.model import DSparkDraft
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.markov import Proposal
from dspark_sgl.speculative.match import (
    MatchChooser,
    MatchConfig,
    MatchIndex,
    brute_force_lookup,
    hybrid_proposal,
)
from dspark_sgl.speculative.target_dist import BatchSampling, RequestSampling, draft_dist
from dspark_sgl.targets import HFTarget
from tests.conftest import draft_config_for, tiny_llama, tiny_with_random_draft
from tests.test_cli import invoke, tiny_dir  # noqa: F401 (tiny_dir: the fixture)
from tests.test_sampling import chi2_pvalue, exact_three_token_distribution

V3, PROMPT_M = 6, [1, 2, 3, 1, 2]  # the suffix [1, 2] occurred before: the match proposes [3, 1, 2]


# ---- the proposer ------------------------------------------------------------------------------------------------
def test_hand_made_sequences():
    idx = MatchIndex(MatchConfig(max_n=4), [5, 6, 7, 8, 5, 6])
    assert idx.lookup(3) == ([7, 8, 5], 2)  # [5, 6] ended at 2
    idx.extend([7])
    assert idx.lookup(8) == ([8, 5, 6, 7], 3)  # [5, 6, 7] ended at 3; the continuation stops at the text's end
    assert MatchIndex(MatchConfig(), [1, 2, 3]).lookup(4) == ([], 0)  # nothing repeats
    assert MatchIndex(MatchConfig(), [4]).lookup(4) == ([], 0)
    assert MatchIndex(MatchConfig(), [4, 4, 4, 4]).lookup(2) == ([4], 3)  # the most recent: [4, 4, 4] ended at 3
    assert MatchIndex(MatchConfig(min_n=2), [9, 1, 9]).lookup(2) == ([], 0)  # a 1-gram match is below min_n
    # the longest match wins over a more recent shorter one
    assert MatchIndex(MatchConfig(), [1, 2, 3, 7, 2, 3, 8, 1, 2, 3]).lookup(2) == ([7, 2], 3)


@pytest.mark.parametrize("cfg", [MatchConfig(), MatchConfig(max_n=3, min_n=2), MatchConfig(max_n=4, window=9),
                                 MatchConfig(max_n=2, window=3)])
def test_incremental_index_equals_brute_force(cfg):
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5])
        text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        cut = rng.randrange(len(text) + 1)
        idx = MatchIndex(cfg, text[:cut])
        for i in range(cut, len(text) + 1):
            gamma = rng.randrange(1, 8)
            assert idx.lookup(gamma) == brute_force_lookup(text[:i], gamma, cfg), (trial, text[:i], gamma)
            if i < len(text):
                idx.extend(text[i : i + 1] if rng.random() < 0.7 else [])
                if len(idx) < i + 1:
                    idx.extend(text[i : i + 1])


def test_memory_is_bounded_by_the_window():
    cfg = MatchConfig(max_n=4, window=64)
    idx = MatchIndex(cfg)
    rng = random.Random(1)
    for _ in range(5000):
        idx.extend([rng.randrange(50)])
    assert all(len(d) <= cfg.window for d in idx._idx)
    assert len(idx._tok) <= 2 * (cfg.window + cfg.max_n) + 2
    text = [rng.randrange(3) for _ in range(3000)]
    idx = MatchIndex(cfg, text)
    assert idx.lookup(5) == brute_force_lookup(text, 5, cfg)


def test_bad_config_is_one_clear_error():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        MatchConfig(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="window"):
        MatchConfig(window=0)


# ---- one-hot q through the shared rules ----------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["rejection", "block"])
def test_a_one_hot_proposal_emits_the_target_distribution(rule):
    V, gamma, n = 6, 3, 100_000
    g = torch.Generator().manual_seed(5)
    p_rows = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    x = torch.tensor([2, 4, 1]).expand(n, -1)
    q = torch.nn.functional.one_hot(x, V).float()
    res = ACCEPT_RULES[rule](x, q, p_rows.expand(n, -1, -1), None, g)
    padded = torch.cat((x, torch.zeros(n, 1, dtype=torch.long)), 1)
    first = padded.scatter(1, res.num_accepted[:, None], res.bonus[:, None])[:, 0]
    assert chi2_pvalue(torch.bincount(first, minlength=V), p_rows[0]) > 1e-3
    assert (res.num_accepted >= 1).double().mean() == pytest.approx(float(p_rows[0, 2]), abs=0.01)
    rejected = res.num_accepted == 0
    assert not (res.bonus[rejected] == 2).any()  # the residual of a one-hot q never redraws x


def test_hybrid_rows_keep_a_reduced_drafts_q_and_make_match_rows_one_hot():
    V, K, gamma = 10, 4, 3
    vocab = torch.tensor([7, 1, 4, 9])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, gamma, K, generator=g)
    tokens = vocab[torch.randint(0, K, (2, gamma), generator=g)]
    prop = Proposal(tokens, logits, None, vocab)
    match = torch.tensor([[3, 3, 8], [0, 5, 6]])
    hyb = hybrid_proposal(prop, match, torch.tensor([False, True]), V)
    s = BatchSampling.from_requests([RequestSampling(temperature=0.8)] * 2, V, "cpu")
    q = draft_dist(hyb.logits, hyb.tokens, s, hyb.vocab, V)
    assert torch.allclose(q[0], draft_dist(logits, tokens, s, vocab, V)[0])
    assert torch.equal(q[1], torch.nn.functional.one_hot(match[1], V).float())
    assert hyb.tokens.tolist() == [tokens[0].tolist(), [0, 5, 6]]


# ---- the hybrid in the reference engine ----------------------------------------------------------------------------
REPEATS = [[3, 7, 1, 9, 4, 3, 7, 1, 9], [5, 5, 2, 8, 5, 5, 2], [11, 12, 13, 14, 15, 11, 12, 13], [2, 9, 2, 9, 2, 9]]


def test_t0_output_is_token_identical_to_plain_decoding_with_the_hybrid():
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(REPEATS, 24)
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=4))
    engine = SpecEngine(target, draft, match=MatchConfig())
    out = engine.generate(REPEATS, 24)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    counters = engine.matcher.counters.to_dict()
    assert counters["steps"]["match"] > 0 and counters["accepted"]["match"] > 0, counters
    assert sum(len(o.stats.from_match) for o in out) == sum(counters["steps"].values())
    # under the full-cost rule switching off and on (issue 41): off steps feed the match index too (a less confident
    # draft, so that the match is chosen on some of the fewer speculative steps)
    from tests.test_fullcost_rule import alternating

    with torch.no_grad():
        draft.confidence_head.proj.bias -= 2.0
    engine = SpecEngine(target, draft, alternating(4, len(REPEATS)), match=MatchConfig())
    assert [o.token_ids for o in engine.generate(REPEATS, 24)] == [r.token_ids for r in ref]
    assert engine.matcher.counters.steps["match"] > 0


def slow_draft_planner(gamma: int, batch_size: int, pass_rate: float = 0.3):
    """The full-cost rule off for the draft (a 30 ms draft before a ~10 ms verify never pays) and match steps priced:
    a plain step 10 ms, a width-w verify 10 + (w - 1) ms."""
    from dspark_sgl.speculative.scheduler import AdaptivePlanner
    from tests.test_fullcost_rule import rule_with, table

    after = [0.010 + 0.001 * (w - 1) for w in range(1, gamma + 2)]
    return AdaptivePlanner(rule_with(table(gamma, 0.010, 0.030, after, batch_size), pass_rate))


def check_match_steps_skip_the_draft() -> tuple[bool, str]:
    """With the rule off for the draft, the hybrid's steps are match steps: T=0 output identical to plain decoding,
    matches verified and accepted, no draft forward at all, and the rule's draft statistics untouched (a match's
    acceptance taken as the draft's would turn a useless draft on)."""
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(REPEATS, 24)
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=4))
    planner = slow_draft_planner(4, len(REPEATS))
    tested = planner.rule.overall.tested.clone()
    calls = []
    forward = draft.forward_step
    draft.forward_step = lambda *a, **k: calls.append(1) or forward(*a, **k)
    engine = SpecEngine(target, draft, planner, match=MatchConfig())
    out = engine.generate(REPEATS, 24)
    counters = engine.matcher.counters.to_dict()
    same = [o.token_ids for o in out] == [r.token_ids for r in ref]
    untouched = torch.equal(planner.rule.overall.tested, tested)
    ok = same and counters["accepted"]["match"] > 0 and not calls and untouched
    return ok, (f"identical {same}, match steps {counters['steps']['match']} accepting {counters['accepted']['match']},"
                f" draft passes {len(calls)}, draft statistics untouched {untouched}")


def test_match_steps_verify_the_matches_without_a_draft_pass():
    ok, detail = check_match_steps_skip_the_draft()
    assert ok, detail


def check_the_rule_weighs_the_matches() -> tuple[bool, str]:
    """Before drafting, the full-cost rule reads the rows' match survival (a function of the committed text): on a
    table where drafting beats a plain step by 25 % (pass rate 0.5, batch 4), it still drafts when one row of four
    has a strong match (the draft adds to the other three), but not when every row has one: a match step (no draft
    pass) then commits as much for less, and `match_width` takes it."""
    from tests.test_fullcost_rule import AFTER, GAMMA, rule_with, table

    def fresh():
        return rule_with(table(GAMMA, 0.010, 0.002, AFTER, 4), 0.5)

    strong = 0.9 ** torch.arange(1, GAMMA + 1, dtype=torch.float64)
    every = strong.expand(4, GAMMA)
    one = torch.cat([strong[None], torch.zeros(3, GAMMA, dtype=torch.float64)])
    alone, with_one, with_every = (fresh().decide(4, m).speculate for m in (None, one, every))
    width = fresh().match_width(4, every)
    ok = alone and with_one and not with_every and width == GAMMA + 1
    return ok, f"drafts: no match {alone}, one row matched {with_one}, every row matched {with_every}; " \
               f"match step width {width}"


def test_the_rule_drafts_only_where_the_draft_adds_to_the_matches():
    ok, detail = check_the_rule_weighs_the_matches()
    assert ok, detail


def check_match_rows_stay_out_of_the_draft_statistics() -> tuple[bool, str]:
    """A drafted step's rows that verified a match (the hybrid's choice) say nothing about the draft: after 20 steps
    where the two match rows accepted all 7 tokens and the two draft rows none, the draft's first-position pass rate
    (the serving planner's record, which the worker calls) is below 0.1."""
    from dspark_sgl.sglang.planning import VerifyPlanner
    from dspark_sgl.speculative.scheduler import Decision
    from tests.conftest import tiny_draft_config
    from tests.test_sglang_planning import spec_args

    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=7)))
    lengths = torch.full((4,), 8)
    from_match = torch.tensor([True, True, False, False])
    for _ in range(20):
        planner.record(lengths, 8, torch.tensor([7, 7, 0, 0]), Decision(True, "rule", 2.0), None,
                       torch.full((4, 7), 0.5), from_match)
    stats = planner.rule.accept[4]
    rate = float(stats.passed[0] / stats.tested[0])
    return rate < 0.1, f"draft pass rate at position 1: {rate:.3f} over {float(stats.tested[0]):.1f} rows"


def test_match_rows_stay_out_of_the_draft_statistics():
    ok, detail = check_match_rows_stay_out_of_the_draft_statistics()
    assert ok, detail


def test_match_width_prices_the_matches_against_a_plain_step():
    """A match step's width from the match survival: wider while the expected tokens pay for the extra columns, 1
    where nothing matched or the operator said off / capped the batch."""
    rule = slow_draft_planner(4, 4).rule
    assert rule.match_width(4, torch.zeros(4, 4)) == 1
    sure = torch.ones(4, 4)  # every row's match of 4 tokens is accepted: the full window pays
    assert rule.match_width(4, sure) == 5
    # per row 1 + 0.5 + 0.25 = 1.75 tokens in 12 ms (146/s) beats 1.5 in 11 (136/s) and 1.875 in 13 (144/s)
    half = torch.tensor([[0.5, 0.25, 0.125, 0.0625]]).expand(4, 4)
    assert rule.match_width(4, half) == 3
    thin = torch.tensor([[0.05, 0.0, 0.0, 0.0]]).expand(4, 4)  # 1.05 in 11 ms does not beat 1 in 10 ms
    assert rule.match_width(4, thin) == 1
    from dspark_sgl.speculative.scheduler import FullCostRule, RuleConfig

    cold = FullCostRule(4, config=RuleConfig(mode="match"))  # nothing timed yet: the longest match's width
    assert not cold.decide(2).speculate and cold.match_width(2, torch.tensor([[0.5, 0.4, 0, 0], [0.5, 0, 0, 0]])) == 3
    assert cold.match_width(2, torch.zeros(2, 4)) == 1
    capped = slow_draft_planner(4, 4).rule
    capped.config = type(capped.config)(**{**capped.config.__dict__, "max_batch": 2})
    assert capped.match_width(4, sure) == 1 and capped.match_width(2, sure) == 5


def full_cost_planner(gamma: int, batch_size: int):
    """issue 41's full-cost rule on a table where a wider verify costs more: the width rule trims by the chosen
    proposals' survival. Mode "on": every step drafts (with the random draft the rule itself would verify the
    matches alone, `test_the_rule_drafts_only_where_the_draft_adds_to_the_matches`), so both kinds of row are seen."""
    from dspark_sgl.speculative.scheduler import AdaptivePlanner
    from tests.test_fullcost_rule import rule_with, table

    return AdaptivePlanner(rule_with(table(gamma, 0.05, 0.001, [0.010, 0.012, 0.02, 0.05], batch_size), 0.5,
                                     mode="on"))


def hybrid_pvalue(n: int = 2000, seed: int = 7, acceptance: str = "rejection", top_p: float = 1.0,
                  reduced: bool = False, full_cost: bool = False, match_steps: bool = False) -> tuple[float, dict]:
    """(chi-square p of the served joint of 3 tokens vs the enumeration, share of request-steps that verified the
    match): the V = 6 target and random draft, a prompt whose suffix occurred before, the hybrid on. The confidence
    head's bias is lowered by 2 so that c_1 and the match's first estimate (0.5) compete: both kinds of row
    are verified, and which one depends on each row's earlier outcomes."""
    model, target, draft = tiny_with_random_draft(V3)
    if reduced:
        from tests.test_draft_vocab import reduced as reduced_draft

        torch.manual_seed(0)
        draft = reduced_draft(target, [1, 4], block_size=3, markov_rank=4)
        with torch.no_grad():
            for prm in draft.parameters():
                prm.normal_(0, 0.5)
    with torch.no_grad():
        draft.confidence_head.proj.bias -= 2.0
    exact = exact_three_token_distribution(model, PROMPT_M, 1.0, top_p, V3)
    planner = full_cost_planner(draft.config.block_size, n) if full_cost else None
    if match_steps:  # the rule off for the draft: the matches alone, as match steps
        planner = slow_draft_planner(draft.config.block_size, n)
    engine = SpecEngine(target, draft, planner, match=MatchConfig())
    out = engine.generate([PROMPT_M] * n, 3, SamplingConfig(temperature=1.0, top_p=top_p, acceptance=acceptance,
                                                            seed=seed))
    seqs = torch.tensor([o.token_ids for o in out])
    counts = torch.bincount(seqs[:, 0] * V3 * V3 + seqs[:, 1] * V3 + seqs[:, 2], minlength=V3**3)
    return chi2_pvalue(counts, exact), engine.matcher.counters.to_dict()


@pytest.mark.parametrize("acceptance,top_p,reduced,full_cost", [("block", 0.8, False, False),
                                                                ("rejection", 1.0, True, True)])
def test_served_distribution_with_the_hybrid_is_the_targets(acceptance, top_p, reduced, full_cost):
    p, counters = hybrid_pvalue(acceptance=acceptance, top_p=top_p, reduced=reduced, full_cost=full_cost)
    assert p > 1e-3
    assert 0.05 < counters["match_share"] < 0.95, counters  # both kinds of row were verified


@pytest.mark.parametrize("acceptance,top_p", [("rejection", 1.0), ("block", 0.8)])
def test_served_distribution_with_match_steps_is_the_targets(acceptance, top_p):
    p, counters = hybrid_pvalue(acceptance=acceptance, top_p=top_p, match_steps=True)
    assert p > 1e-3
    assert counters["steps"]["draft"] == 0 and counters["steps"]["match"] > 500, counters  # match steps, no draft


def test_the_choice_prefers_the_source_that_pays():
    """A request whose matches keep being accepted verifies the match; one whose matches fail goes back to the draft."""
    chooser = MatchChooser(MatchConfig(prior=1.0))
    st = chooser.new_state([1, 2, 3, 1, 2])
    prop = Proposal(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 6), torch.zeros(1, 3))
    greedy = torch.tensor([True])
    weak = torch.full((1, 3), 0.3)
    assert chooser.choose([st], prop, weak, greedy, 6).use_match.tolist() == [True]  # 0.875 vs 0.42
    strong = torch.full((1, 3), 0.95)
    assert chooser.choose([st], prop, strong, greedy, 6).use_match.tolist() == [False]
    for _ in range(5):  # the match of length 2 keeps being rejected at once
        ch = chooser.choose([st], prop, weak, greedy, 6)
        chooser.record([st], ch, [3], [0])
    assert chooser.choose([st], prop, weak, greedy, 6).use_match.tolist() == [False]
    # a sampled row reads only c_1 (its later confidences depend on the sampled drafts)
    fake_high_later = torch.tensor([[0.45, 1.0, 1.0]])  # full survival 1.35, c_1 geometric 0.74, match 0.875
    fresh = MatchChooser(MatchConfig())
    st2 = fresh.new_state([1, 2, 3, 1, 2])
    assert fresh.choose([st2], prop, fake_high_later, torch.tensor([False]), 6).use_match.tolist() == [True]
    assert fresh.choose([st2], prop, fake_high_later, torch.tensor([True]), 6).use_match.tolist() == [False]


def test_generate_and_eval_take_match(tiny_dir, tmp_path):  # noqa: F811
    draft = tmp_path / "draft"
    assert invoke("init-draft", "--target", tiny_dir, "--out", draft, "--layers", "1", "--block-size", "4",
                  "--num-aux", "2").exit_code == 0
    prompt = ["--chat", "one two three one two three one two", "--max-new-tokens", "16", "--json"]
    res = invoke("generate", "--target", tiny_dir, "--draft", draft, "--match", *prompt)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    plain = json.loads(invoke("generate", "--target", tiny_dir, "--no-draft", *prompt).stdout.strip().splitlines()[-1])
    assert out["token_ids"] == plain["token_ids"]
    assert sum(out["match"]["steps"].values()) == sum(out["accept_hist"]) and 0 <= out["match"]["match_share"] <= 1
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"turns": ["a b c a b c a b"]}) + "\n")
    res = invoke("eval", "--target", tiny_dir, "--draft", draft, "--data", data, "--max-new-tokens", "10", "--match",
                 "--json-out", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["meta"]["match"] is True and rep["datasets"][0]["match"]["steps"]
