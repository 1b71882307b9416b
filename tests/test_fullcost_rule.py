"""The full-cost rule (speculative/scheduler.py FullCostRule): speculate only where it pays against a plain step, with
every cost counted; no flapping at a threshold; decided before drafting (lossless); the off step of the reference
engine keeps the output and the draft context exact."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dspark_sgl.faults import plant
from dspark_sgl.model import DSparkDraft
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.scheduler import (
    AdaptivePlanner,
    CostTable,
    FullCostRule,
    RuleConfig,
    batch_bucket,
)
from dspark_sgl.targets import HFTarget
from tests.conftest import draft_config_for, tiny_llama, tiny_with_random_draft
from tests.test_engine import PROMPTS
from tests.test_sampling import chi2_pvalue, exact_three_token_distribution
from tests.test_scheduler import chi_square_pvalue, simulate


def table(gamma: int, off: float, draft: float, after: list[float], batch_size: int = 1) -> CostTable:
    """A cost table with the buckets of batch sizes 1 .. batch_size measured alike: seconds of an off step, of the
    draft, after(w) for w = 1 .. gamma+1."""
    costs = CostTable(gamma + 1)
    for bucket in {batch_bucket(n) for n in range(1, batch_size + 1)}:
        b = costs.bucket(bucket)
        b.off.add(off)
        b.draft.add(draft)
        for w, t in enumerate(after):
            b.after[w].add(t)
    return costs


def rule_with(costs: CostTable, pass_rate: float, **config) -> FullCostRule:
    gamma = costs.width - 1
    rule = FullCostRule(gamma, costs, RuleConfig(**{"cold_samples": 0, "explore_every": 0, **config}),
                        learn_costs=False)
    rule.overall.tested.fill_(1000.0)  # 1000 rows tested every position, each passed at pass_rate
    rule.overall.passed.fill_(1000.0 * pass_rate)
    return rule


GAMMA = 7
AFTER = [0.010 + 0.001 * (w - 1) for w in range(1, GAMMA + 2)]  # a verify barely dearer than a plain step per width


def test_bucket_grid():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 64)] == \
        [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 16, 16, 24, 64]


def check_off_where_the_draft_cannot_pay() -> tuple[bool, str]:
    """A 30 ms draft in front of a ~10 ms verify, 60 % per-position acceptance (E[accepted] <= 1.4): a speculative
    step commits < 2.4 tokens in >= 40 ms, a plain one 1 in 10 ms: the rule must stay off. The same acceptance with a
    2 ms draft pays (2.4 tokens in 19 ms) and the rule must speculate."""
    slow = rule_with(table(GAMMA, 0.010, 0.030, AFTER), 0.6)
    fast = rule_with(table(GAMMA, 0.010, 0.002, AFTER), 0.6)
    off = [slow.decide(1).speculate for _ in range(20)]
    on = [fast.decide(1).speculate for _ in range(20)]
    ok = not any(off) and all(on)
    return ok, f"30 ms draft: speculated {sum(off)}/20; 2 ms draft: {sum(on)}/20"


def test_off_where_speculation_cannot_pay_and_on_where_it_does():
    ok, detail = check_off_where_the_draft_cannot_pay()
    assert ok, detail
    spec, off = rule_with(table(GAMMA, 0.010, 0.002, AFTER), 0.6).rates(1)
    expected = sum(0.6**j for j in range(1, GAMMA + 1))  # at the full window
    assert spec[-1] == pytest.approx((1 + expected) / (0.002 + AFTER[-1]), rel=2e-3) and off == pytest.approx(100.0)


def test_operator_cap_and_modes():
    rule = rule_with(table(GAMMA, 0.010, 0.002, AFTER, batch_size=8), 0.6, max_batch=4)
    assert not rule.decide(8).speculate and rule.decide(8).why == "cap"
    rule.config.max_batch = None
    assert rule.decide(8).speculate
    rule.config.mode = "off"
    assert not rule.decide(8).speculate
    slow = rule_with(table(GAMMA, 0.010, 0.030, AFTER), 0.6, mode="on")
    assert slow.decide(1).speculate and slow.decide(1).why == "forced"
    with pytest.raises(ValueError, match="unknown speculation mode"):
        RuleConfig(mode="sometimes")


WOBBLE = [1.06, 1.12, 1.08, 1.11, 1.055, 1.13, 1.07, 1.09]  # speculative over plain, step after step, around 1.10
DIPS = [1.06, 1.12, 1.08, 1.11, 0.97, 1.13, 1.07, 1.09]  # the same with a real dip below 1 every 8th step


def arms_under_wobble(rule: FullCostRule, wobble: list[float] = WOBBLE, steps: int = 200) -> list[bool]:
    best = max(rule.rates(1)[0])
    off_cost = rule.costs.buckets[1].off
    arms = []
    for step in range(steps):
        off_cost.samples.clear()
        off_cost.add(wobble[step % len(wobble)] / best)  # off rate = 1 / cost: spec / off = the wobble
        arms.append(rule.decide(1).speculate)
    return arms


def run_lengths(arms: list[bool]) -> list[int]:
    runs, n = [], 1
    for a, b in zip(arms, arms[1:], strict=False):
        if a != b:
            runs.append(n)
            n = 0
        n += 1
    return runs + [n]


def test_no_flapping_at_the_threshold():
    """Speculation worth 1.055x .. 1.13x a plain step, wobbling around the 1.10x switch-on threshold: the margin and
    hysteresis switch it on once and keep it on; without hysteresis it flips every few steps. With real dips below
    1x every 8th step, an off state holds at least `dwell` decisions and an on state `dwell_on`."""
    rule = lambda **kw: rule_with(table(GAMMA, 0.010, 0.002, AFTER), 0.6, **kw)  # noqa: E731
    assert run_lengths(arms_under_wobble(rule(dwell=1, dwell_on=1)))[1:] == [199]  # off at 1.06x, then on for good
    naive = run_lengths(arms_under_wobble(rule(dwell=1, dwell_on=1, hysteresis=0.0)))
    assert len(naive) > 60, naive
    arms = arms_under_wobble(rule(dwell=8, dwell_on=3), DIPS)
    dips = run_lengths(arms)
    assert len(dips) < len(run_lengths(arms_under_wobble(rule(dwell=1, dwell_on=1), DIPS))), dips
    first_on = arms.index(True)
    on_runs, off_runs = dips[1::2], dips[2::2]  # arms[0] is off: runs alternate off, on, off, ...
    assert all(r >= 8 for r in off_runs[:-1]) and all(r >= 3 for r in on_runs[:-1]), (first_on, dips)


def check_acceptance_memory_in_rows() -> tuple[bool, str]:
    """A bucket of 16 forgets the previous traffic's acceptance in as many rows as a bucket of 1, i.e. 16x fewer steps:
    after 32 steps of 16 rows that accept nothing, following 32 steps that accepted everything, position 1's pass rate
    is below 0.2; a bucket of 1 after the same 32 steps (32 rows) still half remembers it (above 0.4)."""
    def rate_after(rows: int) -> float:
        rule = FullCostRule(GAMMA, config=RuleConfig(cold_samples=0, explore_every=0))
        for accepted in (GAMMA, 0):
            for _ in range(32):
                rule.observe_accept(rows, GAMMA + 1, torch.full((rows,), accepted))
        stats = rule.accept[batch_bucket(rows)]
        return float(stats.passed[0] / stats.tested[0])

    return rate_after(16) < 0.2 and rate_after(1) > 0.4, f"bucket 16 {rate_after(16):.3f}, bucket 1 {rate_after(1):.3f}"


def test_acceptance_memory_is_counted_in_rows():
    ok, detail = check_acceptance_memory_in_rows()
    assert ok, detail


def test_cold_start_measures_both_arms_then_explores_rarely():
    rule = FullCostRule(GAMMA, config=RuleConfig(cold_samples=3, explore_every=16))
    arms, whys = [], []
    for _ in range(64):
        d = rule.decide(4)
        arms.append(d.speculate)
        whys.append(d.why)
        if d.speculate:
            rule.observe_spec(4, GAMMA + 1, 0.030, 0.012, torch.zeros(4, dtype=torch.long))
        else:
            rule.observe_off(4, 0.010)
    # each arm's first step is its warm-up (prices nothing, `CostTable._warm`), then 3 priced steps
    assert arms[:8] == [True] * 4 + [False] * 4 and whys[:8] == ["cold"] * 8
    # a 30 ms draft and nothing accepted: off from then on, but every 16th decision of the bucket explores
    assert [i for i in range(8, 64) if arms[i]] == [15, 31, 47, 63] and {whys[i] for i in (15, 31)} == {"explore"}


def check_costs_are_ordered() -> tuple[bool, str]:
    """Noisy medians may price a width-2 verify below an off step (stop 46's served bucket 4: 105 ms against 134) or a
    width below a narrower one. Priced as measured, a draft accepted 10 % of the time "pays" (1.1 tokens in 10 ms
    against 1 in 12); floored to an off step's cost, it does not, and the widths come out non-decreasing."""
    costs = table(GAMMA, 0.012, 0.002, [0.012, 0.008, 0.020, 0.015, 0.030, 0.030, 0.030, 0.030])
    rule = rule_with(costs, 0.1)
    after = costs.buckets[1].after_seconds()
    ordered = all(b >= a for a, b in zip(after, after[1:], strict=False)) and min(after) >= 0.012
    speculated = rule.decide(1).speculate
    return ordered and not speculated, f"T_after(w) ms {[round(t * 1e3, 1) for t in after]}, speculated {speculated}"


def test_costs_are_floored_by_an_off_step_and_ordered_by_width():
    ok, detail = check_costs_are_ordered()
    assert ok, detail


def check_steps_stay_within_the_bound() -> tuple[bool, str]:
    """Issue 41: no decode step longer than 2x its bucket's typical step. A bucket-16 table shaped like stop 46's
    served one (off 145 ms, draft 50 ms, T_after 145 .. 386 ms; its steps' median 153 ms) and a draft or match whose
    tokens survive at 0.9 per position: tokens/s alone pick width 8 (436 ms drafted, 386 ms as a match step); bounded
    by 2 x 153 = 306 ms, the rule drafts at <= 3 and matches at <= 4, and still speculates (width 3 pays 1.4x plain).
    At batch 1 (off 66 ms, a width-8 drafted step 127 ms, median 65 ms) the bound does not bind: width 8."""
    after16 = [0.145, 0.200, 0.225, 0.278, 0.326, 0.346, 0.366, 0.386]
    wide = rule_with(table(GAMMA, 0.145, 0.050, after16, batch_size=16), 0.9, max_step_ratio=2.0)
    for _ in range(40):
        wide.costs.bucket(16).add_step(0.153, served=True)
    conf = torch.full((16, GAMMA), 0.9, dtype=torch.float64)
    surv = conf.cumprod(1)
    spec16, width16, match16 = wide.decide(16).speculate, int(wide.widths(conf).max()), wide.match_width(16, surv)
    narrow = rule_with(table(GAMMA, 0.066, 0.012, [0.066, 0.085, 0.085, 0.098, 0.098, 0.098, 0.115, 0.115]), 0.9,
                       max_step_ratio=2.0)
    for _ in range(40):
        narrow.costs.bucket(1).add_step(0.065, served=True)
    width1 = int(narrow.widths(conf[:1]).max())
    ok = spec16 and width16 <= 3 and match16 <= 4 and width1 == GAMMA + 1
    return ok, (f"batch 16: speculates {spec16}, drafted width {width16}, match width {match16}; batch 1: drafted "
                f"width {width1}")


def test_no_step_is_priced_past_twice_the_buckets_typical_step():
    ok, detail = check_steps_stay_within_the_bound()
    assert ok, detail


def profiled(batch_size: int, off: float, draft: float, after: list[float], rounds: int = 10) -> CostTable:
    """A table as `dspark profile-costs` leaves a bucket: its forced arms, off steps and full-width drafted steps
    (`after` at widths 1 .. gamma + 1, each drafted width timed `rounds` times), none of them served."""
    costs = CostTable(len(after))
    for _ in range(rounds):
        costs.observe_off(batch_size, off, served=False)
        for w, t in enumerate(after[1:], start=2):
            if t is not None:
                costs.observe_spec(batch_size, w, draft, t, served=False)
    return costs


def check_the_bound_reads_served_steps_only() -> tuple[bool, str]:
    """Stop 49's bucket 6 (batches 5-6), as its start-up profile left it: off steps of 118 ms and full-width drafted
    steps (after(7) 224 ms, after(8) 245 ms, draft 29 ms), median 253 ms; served, its steps' median was 143 ms and
    width-7/8 match steps of up to 324 ms (2.2x) ran. Matches surviving at 0.95 per position pay most at width 8.
    Before a step is served the profile's median is the reference (1.7 x 253 ms: a width-8 match step of 245 ms
    fits); after 8 served steps of 143 ms their median is (bound 243 ms): width 7 (224 ms) fits, width 8 does not.
    Planted `forced_typical` (the profile's steps counted as served, the median stays 253 ms): width 8."""
    costs = profiled(6, 0.118, 0.029, [0.118, None, None, None, None, None, 0.224, 0.245])
    rule = FullCostRule(GAMMA, costs, RuleConfig(cold_samples=0, explore_every=0), learn_costs=False)
    surv = torch.full((6, GAMMA), 0.95, dtype=torch.float64).cumprod(1)  # tokens/s alone pick width 8
    before = rule.match_width(6, surv), round(costs.reference_seconds(6), 3)
    for _ in range(8):
        costs.observe_match(6, 2, 0.143)
    after = rule.match_width(6, surv), round(costs.reference_seconds(6), 3)
    ok = before == (8, 0.253) and after == (7, 0.143)
    return ok, f"(match width, reference s): profiled only {before}, after 8 served steps {after}"


def test_the_bound_reads_served_steps_only():
    ok, detail = check_the_bound_reads_served_steps_only()
    assert ok, detail


def test_a_profiled_batch_of_one_drafts_wide():
    """The served test's bucket 1 (2-core EPYC, bigram draft): off 77 ms, draft 39 ms, T_after 77 .. 116 ms, so a
    width-8 drafted step costs 155 ms, 2x a plain step. Stop 50 bounded steps by 1.7 plain steps until 8 were served:
    the rule never drafted wider than 2, drafting never paid, and the server kept plain steps (accept length 1.03 for
    a draft giving ~2.5). With the profile's median as the reference (116 ms), and then the served drafted steps',
    a draft passing 0.7 per position is drafted at width 8."""
    after = [0.077, 0.090, 0.092, 0.104, 0.104, 0.110, 0.113, 0.116]
    costs = profiled(1, 0.077, 0.039, after)
    rule = FullCostRule(GAMMA, costs, RuleConfig(cold_samples=0, explore_every=0), learn_costs=False)
    rule.overall.tested.fill_(1000.0)
    rule.overall.passed.fill_(700.0)
    conf = torch.full((1, GAMMA), 0.7, dtype=torch.float64)
    assert rule.decide(1).speculate and int(rule.widths(conf).max()) == GAMMA + 1
    for _ in range(8):
        costs.observe_spec(1, GAMMA + 1, 0.039, 0.116)
    assert costs.reference_seconds(1) == pytest.approx(0.155)
    assert rule.decide(1).speculate and int(rule.widths(conf).max()) == GAMMA + 1


def check_the_draft_is_learnt_before_it_is_priced() -> tuple[bool, str]:
    """A server with a loaded cost table and no acceptance data: the draft's survival is the prior 0.5 per position,
    and every row has a match at the same prior, which costs no draft pass, so the priced rule would never draft and
    never learn that this draft accepts everything. The first drafted steps are taken to learn ("learn"); after
    them the rule drafts on its own ("rule") for all 20 steps."""
    rule = FullCostRule(GAMMA, table(GAMMA, 0.010, 0.002, AFTER), RuleConfig(cold_samples=0, explore_every=0),
                        learn_costs=False)
    match = 0.5 ** torch.arange(1, GAMMA + 1, dtype=torch.float64)[None]
    whys = []
    for _ in range(20):
        d = rule.decide(1, match)
        whys.append(d.why if d.speculate else "off")
        if d.speculate:
            rule.observe_accept(1, GAMMA + 1, torch.tensor([GAMMA]))
    learnt = whys[:8] == ["learn"] * 8 and whys[8:] == ["rule"] * 12
    return learnt, f"decisions {Counter(whys)}"


def test_a_fresh_server_drafts_to_learn_before_it_prices_the_draft():
    ok, detail = check_the_draft_is_learnt_before_it_is_priced()
    assert ok, detail


def check_requests_rates() -> tuple[bool, str]:
    """The bucket's acceptance mixes every request it served. After 40 steps at batch 2 where request "code" accepted
    every draft and request "prose" none (the bucket's pass rate is half of each), the rule drafts for a batch of
    "code" alone and not for "prose" alone; a new request takes the bucket's rate (it drafts, as the table pays at
    0.5)."""
    def history() -> FullCostRule:
        rule = rule_with(table(GAMMA, 0.010, 0.002, AFTER, batch_size=2), 0.5)
        for _ in range(40):
            rule.observe_accept(2, GAMMA + 1, torch.tensor([GAMMA, 0]), keys=["code", "prose"])
        return rule

    got = {k: history().decide(2, keys=[k, k]).speculate for k in ("code", "prose", "new")}
    scale = history().requests.scale(["code", "prose", "new"]).tolist()
    return got == {"code": True, "prose": False, "new": True}, \
        f"drafts for {got}; realized / expected {[round(x, 2) for x in scale]}"


def test_the_rule_reads_each_requests_acceptance():
    ok, detail = check_requests_rates()
    assert ok, detail


def test_costs_are_a_table_by_batch_and_width():
    """B = 8 at width 2 and B = 16 at width 1 are different cells (the SPS table keyed both by 16 tokens); a width
    never measured is interpolated between measured widths and never priced below the widest one past it."""
    costs = CostTable(GAMMA + 1)
    for warm_up in (10, 1):  # each cell's first step in a process is its warm-up: it prices nothing
        costs.observe_spec(8, 2, 0.002 * warm_up, 0.020 * warm_up)
        costs.observe_off(16, 0.050 * warm_up)
        costs.observe_spec(8, 8, 0.002 * warm_up, 0.044 * warm_up)
    assert costs.spec_seconds(16) is None and costs.off_seconds(8) is None
    spec8 = costs.spec_seconds(8)
    assert spec8[1] == pytest.approx(0.022) and spec8[7] == pytest.approx(0.046)
    assert spec8[4] == pytest.approx(0.002 + 0.020 + 0.024 * 3 / 6)
    assert spec8[0] == pytest.approx(0.022)  # below the narrowest measured: its value
    one = CostTable(GAMMA + 1)
    one.observe_spec(2, 4, 0.001, 0.040)
    assert one.spec_seconds(2) is None  # the warm-up
    one.observe_spec(2, 4, 0.001, 0.040)
    assert one.spec_seconds(2)[7] == pytest.approx(0.001 + 0.080)  # one width measured: proportional above it
    again = CostTable.from_dict(costs.to_dict())
    assert again.spec_seconds(8) == spec8
    again.observe_spec(8, 8, 0.002, 0.440)  # a new process (a loaded table) warms up again: the first step is not
    assert again.spec_seconds(8) == spec8  # a sample; later ones are
    again.observe_spec(8, 8, 0.002, 0.046)
    assert again.spec_seconds(8)[7] == pytest.approx(0.002 + 0.045)


def check_a_warm_up_step_prices_nothing() -> tuple[bool, str]:
    """Stop 51's GSM8K run at batch 1 (2-core EPYC): the profile's first drafted step ran at width 8 and took 460 ms
    (one-off work of a first step: packing, allocation); the rule then drafted at widths <= 6 (off 80 ms, width 6 134
    ms with the draft), so that one sample priced width 8 for the whole run and was never corrected: 7 and 8 never
    ran. Its first step ignored, width 8 is priced on the line through the measured widths (~152 ms) and a draft
    passing 0.9 per position is verified at width 8. Planted `warmup_priced`: width 8 costs 460 ms; width 6."""
    rule = FullCostRule(GAMMA, config=RuleConfig(cold_samples=0, explore_every=0))
    rule.costs.observe_spec(1, GAMMA + 1, 0.010, 0.450, served=False)
    for _ in range(6):
        rule.costs.observe_off(1, 0.080, served=False)
        rule.costs.observe_spec(1, 6, 0.010, 0.124, served=False)
    width = int(rule.widths(torch.full((1, GAMMA), 0.9, dtype=torch.float64)).max())
    ms = round(1e3 * rule.costs.spec_seconds(1)[GAMMA])
    return width == GAMMA + 1, f"width {width}, width {GAMMA + 1} priced {ms} ms"


def test_a_warm_up_step_prices_nothing():
    ok, detail = check_a_warm_up_step_prices_nothing()
    assert ok, detail


def check_cold_steps_stay_narrow() -> tuple[bool, str]:
    """A bucket with no costs (above the start-up profile's 16, or no profile at all): the rule's cold drafted and
    match steps verify at most `cold_columns` (32) columns, never below width 2: batch 32 at width 2, batch 8 at 4,
    batch 1 at the whole window; a forced step (the operator's switch) still verifies the whole window. Planted
    `cold_wide`: batch 32 drafts and matches at width 8 (256 columns on a guess)."""
    rule = FullCostRule(GAMMA, config=RuleConfig(cold_samples=3, explore_every=0))
    sure = torch.full((32, GAMMA), 0.9, dtype=torch.float64)
    cold = rule.decide(32)
    drafted = {b: int(rule.widths(sure[:b]).max()) for b in (1, 8, 32)}
    matched = {b: rule.match_width(b, sure[:b]) for b in (1, 8, 32)}
    forced = int(rule.widths(sure, bounded=False).max())
    want = {1: GAMMA + 1, 8: 4, 32: 2}
    ok = cold.speculate and cold.why == "cold" and drafted == want and matched == want and forced == GAMMA + 1
    return ok, f"drafted {drafted}, matched {matched}, forced {forced}"


def test_cold_steps_stay_narrow():
    ok, detail = check_cold_steps_stay_narrow()
    assert ok, detail


def test_acceptance_is_learnt_per_position_and_calibrates_the_head():
    rule = FullCostRule(3)
    for _ in range(200):  # rows accept 0, 1, 2, 3 drafts equally often at the full width
        rule.observe_spec(4, 4, None, None, torch.tensor([0, 1, 2, 3]), torch.full((4, 3), 0.9))
    expected = rule.overall.expected_accepted()
    assert expected.tolist() == pytest.approx([0.0, 0.75, 1.25, 1.5], abs=0.01)
    # the head said 0.9, 0.81, 0.73; realized 0.75, 0.5, 0.25: the calibrated survival follows the realized one
    assert rule.calibrated_survival(torch.full((1, 3), 0.9))[0].tolist() == pytest.approx([0.75, 0.5, 0.25], abs=0.02)


def test_width_decisions_read_no_later_column():
    """After drafting: whether column d is verified must not depend on the survival factors of columns > d."""
    gen = torch.Generator().manual_seed(4)
    rule = rule_with(table(GAMMA, 0.010, 0.004, [0.010, 0.011, 0.013, 0.016, 0.020, 0.025, 0.031, 0.038],
                           batch_size=4), 0.6)
    for _ in range(40):  # a non-trivial calibration
        rule.observe_spec(4, 8, None, None, torch.randint(0, 8, (4,), generator=gen), torch.rand(4, 7, generator=gen))
    widths = set()
    for _ in range(200):
        conf = torch.rand(4, 7, generator=gen) ** 0.3
        d = int(torch.randint(0, 7, (1,), generator=gen))
        other = conf.clone()
        other[:, d + 1:] = torch.rand(4, 6 - d, generator=gen)
        lengths = rule.widths(conf)
        widths.add(int(lengths[0]))
        assert torch.equal(lengths >= d + 2, rule.widths(other) >= d + 2)
    assert len(widths) >= 2  # the width really depends on the drafts


# --- exactness: decided before drafting (the toy chain of tests/test_scheduler.py) --------------------------------
# From anchor 2: c_1 = 0.5 and c_2 = G[x_1] (0.9, 0.1, 0.5). Costs: a plain step 1 s, a draft 0.7 s, any verify 1 s.
# The exact rule verifies every column (a flat verify cost). The planted rule turns speculation off after drafting
# when this step's survivals say the block does not pay, (1 + sum a) / 1.7 <= 1: exactly when x_1 = 1, so x_1 = 1 is
# never tested and the first token is 1 with probability 0.125 instead of P(1) = 0.3.
def toy_rule() -> FullCostRule:
    return rule_with(table(3, 1.0, 0.7, [1.0] * 4, batch_size=1), 0.5, mode="on")


def peek_pvalue() -> float:
    rule = toy_rule()
    anchors = torch.full((20000, 1), 2)
    out, lengths = simulate(lambda conf, _sps: rule.widths(conf), anchors, seed=5)
    return chi_square_pvalue(out, [2]), set(lengths.tolist())


def check_decided_before_drafting() -> tuple[bool, str]:
    p, lengths = peek_pvalue()
    return p > 1e-3, f"chi-square p = {p:.3g}, verify lengths {sorted(lengths)}"


def test_deciding_after_the_drafts_is_caught_by_the_distribution_test():
    ok, detail = check_decided_before_drafting()
    assert ok, detail
    with plant("decide_peek"):
        bad, planted_detail = check_decided_before_drafting()
    assert not bad, planted_detail
    assert "1]" in planted_detail or "1," in planted_detail  # the plant did turn steps off


# --- the reference engine switching between off and on inside one request ---------------------------------------
def alternating(gamma: int, batch_size: int) -> AdaptivePlanner:
    """Speculation does not pay on this table (a 50 ms draft), and every 2nd decision of a bucket explores a
    speculative step: off, on, off, on, ... (a batch that shrinks starts a new bucket: off again)."""
    costs = table(gamma, 0.010, 0.050, [0.010] * (gamma + 1), batch_size=batch_size)
    return AdaptivePlanner(rule_with(costs, 0.5, explore_every=2, dwell=1))


def test_engine_switching_off_and_on_is_token_identical_at_t0():
    target = HFTarget(tiny_llama(), [0, 2])
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=4))
    ref = SpecEngine(target).generate(PROMPTS, 24)
    planner = alternating(4, len(PROMPTS))
    out = SpecEngine(target, draft, planner).generate(PROMPTS, 24)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    spec_steps = len(out[0].stats.accepted)
    assert 0 < spec_steps and planner.rule._state[batch_bucket(4)].decisions > spec_steps  # both arms ran


# The draft context after off steps: tests/test_faults.py::test_off_steps_keep_the_draft_context_exact (it shares the
# context-from-scratch check of the context_keep plant).


def test_engine_switching_off_and_on_samples_the_target_distribution():
    V = 6
    model, target, draft = tiny_with_random_draft(V)
    prompt, n = [1, 2, 3], 6000
    exact = exact_three_token_distribution(model, prompt, 1.0, 1.0, V)
    planner = alternating(draft.config.block_size, n)
    out = SpecEngine(target, draft, planner).generate([prompt] * n, 3, SamplingConfig(temperature=1.0, seed=11))
    seqs = torch.tensor([o.token_ids for o in out])
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3)
    assert chi2_pvalue(counts, exact) > 1e-3
    state = planner.rule._state[batch_bucket(n)]
    assert state.decisions == 2 and state.speculated == 1  # an off step, then a speculative one
    assert sum(sum(o.stats.accepted) for o in out) > 0.1 * n
