"""Lossless under sampling: the emitted tokens are distributed exactly as the target's own samples.

Two levels: the acceptance rules alone (context-free p and q, so the emitted tokens are i.i.d. from p and a
wrong residual shows up at once), and the whole engine on a tiny-vocabulary target (exact joint distribution of
the first three tokens by enumeration). Chi-square with fixed seeds; a wrong rule gives p-values ~ 0.
"""

import pytest
import torch
from scipy.stats import chisquare

from dspark_sgl.kernels.accept_reference import ACCEPT_RULES, _residual
from dspark_sgl.kernels.noise import sample
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.sampling import target_probs
from tests.conftest import tiny_with_random_draft


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells with small expectation are pooled into one."""
    n = observed.sum()
    exp = probs.double() / probs.double().sum() * n
    big = exp >= min_expected
    obs_c = torch.cat((observed[big].double(), observed[~big].double().sum()[None]))
    exp_c = torch.cat((exp[big], exp[~big].sum()[None]))
    keep = exp_c > 0
    exp_c = exp_c * obs_c[keep].sum() / exp_c[keep].sum()
    return float(chisquare(obs_c[keep].numpy(), exp_c[keep].numpy()).pvalue)


def accept_rule_samples(rule, p_rows, q_rows, n, limit=None, seed=0):
    """Emitted tokens of one verify step: x_1..x_c then the bonus; returns the first two emitted tokens."""
    g = torch.Generator().manual_seed(seed)
    gamma = q_rows.shape[0]
    q = q_rows.expand(n, -1, -1)
    p = p_rows.expand(n, -1, -1)
    x = sample(q, g)
    lim = None if limit is None else torch.full((n,), limit)
    res = rule(x, q, p, lim, g)
    padded = torch.cat((x, torch.zeros(n, 1, dtype=torch.long)), 1)
    emitted = padded.scatter(1, res.num_accepted[:, None], res.bonus[:, None])  # x_1..x_c, bonus, ...
    two = res.num_accepted >= 1  # rows that emitted at least two tokens
    return emitted[:, 0], emitted[two, 1], res.num_accepted, gamma


@pytest.mark.parametrize("rule", ["rejection", "block"])
@pytest.mark.parametrize("limit", [None, 1])
def test_acceptance_rules_emit_target_distribution(rule, limit):
    V, gamma = 6, 3
    g = torch.Generator().manual_seed(42)
    p_rows = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)  # context-free target
    q_rows = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)  # a poor draft: many rejections
    first, second, c, _ = accept_rule_samples(ACCEPT_RULES[rule], p_rows, q_rows, 200_000, limit)
    # token 1 ~ p_1 and token 2 ~ p_2 (the target's rows), whatever was accepted
    assert chi2_pvalue(torch.bincount(first, minlength=V), p_rows[0]) > 1e-3
    assert chi2_pvalue(torch.bincount(second, minlength=V), p_rows[1]) > 1e-3
    assert int(c.max()) == (gamma if limit is None else limit)
    assert 0 < float(c.float().mean()) < gamma


@pytest.mark.parametrize("rule", ["rejection", "block"])
def test_a_verify_of_the_anchor_alone_samples_the_bonus_from_p(rule):
    """The scheduler may admit no draft (a window of one token): no drafts in, the bonus ~ p_1 out."""
    V, n = 6, 100_000
    p_row = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5, -1)
    g = torch.Generator().manual_seed(0)
    res = ACCEPT_RULES[rule](torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0, V), p_row.expand(n, 1, V),
                             torch.zeros(n, dtype=torch.long), g)
    assert int(res.num_accepted.max()) == 0
    assert chi2_pvalue(torch.bincount(res.bonus, minlength=V), p_row) > 1e-3


def test_a_wrong_residual_is_caught():
    """The same test with the bonus drawn from p instead of the residual must fail: the test has teeth."""
    V, gamma = 6, 3
    g = torch.Generator().manual_seed(42)
    p_rows = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    q_rows = torch.softmax(torch.randn(gamma, V, generator=g) * 1.5, -1)

    def wrong(x, q, p, limit, gen):
        import dspark_sgl.kernels.accept_reference as acc

        original = acc._residual
        acc._residual = lambda p_, q_: p_ / p_.sum(-1, keepdim=True)
        try:
            return acc.rejection_accept(x, q, p, limit, gen)
        finally:
            acc._residual = original

    first, *_ = accept_rule_samples(wrong, p_rows, q_rows, 200_000)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p_rows[0]) < 1e-6
    assert torch.allclose(_residual(p_rows[0], p_rows[0]), p_rows[0])


def block_beats_tokenwise():
    V, gamma = 6, 4
    g = torch.Generator().manual_seed(3)
    p_rows = torch.softmax(torch.randn(gamma + 1, V, generator=g), -1)
    q_rows = torch.softmax(torch.randn(gamma, V, generator=g), -1)
    _, _, c_rej, _ = accept_rule_samples(ACCEPT_RULES["rejection"], p_rows, q_rows, 100_000)
    _, _, c_blk, _ = accept_rule_samples(ACCEPT_RULES["block"], p_rows, q_rows, 100_000)
    return float(c_rej.float().mean()), float(c_blk.float().mean())


def test_block_verification_accepts_at_least_as_many():
    rej, blk = block_beats_tokenwise()
    assert blk >= rej - 0.01, (rej, blk)


def exact_three_token_distribution(model, prompt, temperature, top_p, V):
    probs = torch.zeros(V, V, V)
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1], temperature, top_p)
        for a in range(V):
            p2 = target_probs(model(torch.tensor([prompt + [a]])).logits[0, -1], temperature, top_p)
            for b in range(V):
                p3 = target_probs(model(torch.tensor([prompt + [a, b]])).logits[0, -1], temperature, top_p)
                probs[a, b] = p1[a] * p2[b] * p3
    return probs.flatten()


@pytest.mark.parametrize("acceptance,top_p,scheduled", [
    ("rejection", 1.0, None), ("block", 1.0, None), ("rejection", 0.8, None), ("block", 0.8, None),
    ("rejection", 1.0, "ragged"), ("block", 0.8, "ragged"), ("rejection", 1.0, "padded"), ("block", 0.8, "padded")])
def test_engine_samples_equal_the_target_distribution(acceptance, top_p, scheduled):
    V = 6
    model, target, draft = tiny_with_random_draft(V)
    prompt, n = [1, 2, 3], 6000
    exact = exact_three_token_distribution(model, prompt, 1.0, top_p, V)
    planner = None
    if scheduled:  # confidence-scheduled verify lengths (Algorithm 1) must keep the distribution exact
        from dspark_sgl.speculative.scheduler import ConfidencePlanner
        from dspark_sgl.speculative.sps import SpsTable
        from tests.test_engine import steep_sps

        sps = steep_sps()
        if scheduled == "padded":  # one width for all n rows: the same steepness per row as the ragged case
            sps = SpsTable([n * t for t in sps.tokens], sps.steps_per_s)
        planner = ConfidencePlanner(sps, padded=scheduled == "padded")
    out = SpecEngine(target, draft, planner).generate(
        [prompt] * n, 3, SamplingConfig(temperature=1.0, top_p=top_p, acceptance=acceptance, seed=7))
    seqs = torch.tensor([o.token_ids for o in out])
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3)
    assert chi2_pvalue(counts, exact) > 1e-3
    assert sum(sum(o.stats.accepted) for o in out) > (0.1 if scheduled else 0.2) * n  # drafts really accepted
    verified = {v for o in out for v in o.stats.verified}
    if scheduled == "ragged":  # and the schedule really varied the verify lengths
        assert len(verified) > 1
    if scheduled:  # the schedule really trimmed the window somewhere (one width per batch step when padded)
        assert min(verified) < draft.config.block_size
    if top_p < 1.0:  # tokens outside the nucleus never appear
        assert counts[exact == 0].sum() == 0
    # and the plain sampler agrees with the same enumeration (the test's own reference is right)
    plain = SpecEngine(target).generate([prompt] * n, 3, SamplingConfig(temperature=1.0, top_p=top_p, seed=8))
    ps = torch.tensor([o.token_ids for o in plain])
    pc = torch.bincount(ps[:, 0] * V * V + ps[:, 1] * V + ps[:, 2], minlength=V ** 3)
    assert chi2_pvalue(pc, exact) > 1e-3
