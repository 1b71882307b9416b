import itertools
import math
import random

import pytest
import torch
from scipy.stats import chisquare

from dspark_sgl.kernels.accept_reference import ACCEPT_RULES
from dspark_sgl.speculative.markov import Proposal
from dspark_sgl.speculative.scheduler import (
    ConfidencePlanner,
    confidence_verify_lengths,
    lengths_from_admitted,
    padded_verify_lengths,
    rank_candidates,
    schedule,
    throughput_curve,
)
from dspark_sgl.speculative.sps import SpsTable

FLAT = SpsTable([1], [100.0])


def ranked_survivals(conf):
    num_req, gamma = len(conf), len(conf[0])
    survival = [
        [math.prod(max(0.0, min(1.0, c)) for c in row[: j + 1]) for j in range(gamma)] for row in conf
    ]
    return sorted(
        ((survival[r][j], j, r) for r in range(num_req) for j in range(gamma)),
        key=lambda t: (-t[0], t[1], t[2]),
    )


def lengths_of(admitted, num_req):
    for r, j in admitted:  # the ranking must make every admitted set a per-request prefix
        assert all((r, i) in admitted for i in range(j))
    return [1 + sum(1 for rr, _ in admitted if rr == r) for r in range(num_req)]


def slow_schedule(conf, sps):
    """The look-ahead rule, one candidate at a time and by brute force over every longer prefix (no plateau
    shortcut): admit candidate i while some prefix m >= i, counting candidates i..m at survival a_i, beats the
    current throughput."""
    ranked = ranked_survivals(conf)
    num_req, n = len(conf), len(ranked)
    batch, tau = num_req, float(num_req)
    admitted = []
    for i, (a, j, r) in enumerate(ranked):
        best_later = max((tau + (m - i + 1) * a) * sps(num_req + m + 1) for m in range(i, n))
        if not best_later > tau * sps(batch):
            break
        batch, tau = batch + 1, tau + a
        admitted.append((r, j))
    return lengths_of(admitted, num_req)


def first_dip_schedule(conf, sps):
    """Algorithm 1 as written in the paper: break at the first candidate that does not raise Theta."""
    num_req = len(conf)
    batch, tau = num_req, float(num_req)
    best = tau * sps(batch)
    admitted = []
    for a, j, r in ranked_survivals(conf):
        theta = (tau + a) * sps(batch + 1)
        if not theta > best:
            break
        batch, tau, best = batch + 1, tau + a, theta
        admitted.append((r, j))
    return lengths_of(admitted, num_req)


def peek_ahead_lengths(conf, sps):
    """DELIBERATELY WRONG: admit the global argmax of Theta over all k instead of stopping early. It looks
    at candidates ranked below (r, j), whose survival depends on the draft token x[r, j] under test."""
    a_sorted, request_ids, _ = rank_candidates(conf)
    theta = throughput_curve(a_sorted, conf.shape[0], sps)
    return lengths_from_admitted(request_ids, theta.argmax(), conf.shape[0])


def test_single_request_edges():
    steep = SpsTable([1, 2, 3], [100.0, 40.0, 10.0])
    assert schedule(torch.zeros(1, 7), FLAT).tolist() == [1]
    assert schedule(torch.ones(1, 7), FLAT).tolist() == [8]
    assert schedule(torch.ones(1, 7), steep).tolist() == [1]  # 2 * 40 < 1 * 100
    assert schedule(torch.tensor([[0.9, 0.0, 1.0]]), FLAT).tolist() == [2]
    assert schedule(torch.full((1, 3), float("nan")), FLAT).tolist() == [1]
    assert schedule(torch.rand(1, 7), FLAT, "static").tolist() == [8]
    assert schedule(torch.zeros(0, 7), FLAT).tolist() == []
    assert schedule(torch.zeros(3, 0), FLAT).tolist() == [1, 1, 1]


def test_all_one_confidence_looks_past_a_step_that_pays_and_stops_at_one_that_does_not():
    # Theta_k = (R + k) * SPS(R + k) with R = 2: 200, 300, 400, 500, then 480, 560, ..., 800 past the step at 6
    # tokens: the paper's rule stops at 3 (480 < 500), the look-ahead sees 800 and admits all 8
    step = SpsTable([2, 5, 6], [100.0, 100.0, 80.0])
    assert sorted(first_dip_schedule(torch.ones(2, 4).tolist(), step)) == [2, 3]
    assert schedule(torch.ones(2, 4), step).tolist() == [5, 5]
    # a knee that never pays back (6 tokens and more at 40: at most 10 * 40 = 400 < 500): both stop at 3
    knee = SpsTable([2, 5, 6], [100.0, 100.0, 40.0])
    assert sorted(schedule(torch.ones(2, 4), knee).tolist()) == [2, 3]


def test_the_tp1_table_that_stopped_the_paper_rule():
    """The SPS table a real TP=1 CPU server measured for 4 requests (docs/serving.md): a 22 % step at 8 tokens.
    The paper's rule verifies 7 tokens in all; the look-ahead whole blocks, for about 1.9x the expected rate."""
    table = {1: 45.2, 2: 44.5, 7: 44.5, 8: 34.9, 16: 32.3, 24: 24.7}
    sps = SpsTable(list(table), list(table.values()))
    conf = torch.full((4, 7), 0.95)
    assert first_dip_schedule(conf.tolist(), sps) == [2, 2, 2, 1]
    ours = schedule(conf, sps)
    assert ours.tolist() == [8, 8, 8, 8]

    def rate(lengths):
        tau = sum(1 + sum(0.95 ** (j + 1) for j in range(n - 1)) for n in lengths)
        return tau * sps(sum(lengths))

    assert rate(ours.tolist()) > 1.8 * rate([2, 2, 2, 1])


def test_ties_are_broken_by_position_then_request():
    # every request has survivals (0.5, 0.25); Theta = 3, 3.5, 4, then 3.6 at the step (6 tokens): the paper's rule
    # admits exactly two candidates, in (position, request) order; the look-ahead crosses the step (Theta 4.2 with
    # all six admitted)
    sps = SpsTable([3, 6], [1.0, 0.8])
    conf = torch.full((3, 2), 0.5)
    assert first_dip_schedule(conf.tolist(), sps) == [2, 2, 1]
    assert schedule(conf, sps).tolist() == [3, 3, 3]
    _, req, pos = rank_candidates(conf)
    assert req.tolist() == [0, 1, 2, 0, 1, 2] and pos.tolist() == [0, 0, 0, 1, 1, 1]


def test_ranking_is_prefix_closed_with_ties_and_ones():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        conf = torch.randint(0, 4, (5, 6), generator=gen).float() / 3  # many exact ties, zeros and ones
        _, req, pos = rank_candidates(conf)
        seen = set()
        for r, j in zip(req.tolist(), pos.tolist(), strict=True):
            assert j == 0 or (r, j - 1) in seen
            seen.add((r, j))


def random_cases(seed: int, n: int = 300):
    """(conf, sps): random confidences (every 5th with exact ties) and tables (every 7th not monotone)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(n):
        num_req, gamma = rng.randint(1, 9), rng.randint(1, 8)
        conf = torch.rand(num_req, gamma, generator=gen) ** rng.choice([0.2, 1.0, 3.0])
        if trial % 5 == 0:
            conf = (conf * 4).round() / 4  # exact ties
        population = range(1, num_req * (gamma + 1) + 3)
        counts = sorted(rng.sample(population, min(len(population), rng.randint(1, 6))))
        rates = sorted((rng.uniform(1, 100) for _ in counts), reverse=True)
        if trial % 7 == 0:
            rates = [rng.uniform(1, 100) for _ in counts]  # not monotone: still must agree
        yield conf, SpsTable(counts, rates)


def test_matches_the_loop_reference_on_random_inputs():
    for conf, sps in random_cases(0):
        gamma = conf.shape[1]
        got = confidence_verify_lengths(conf, sps)
        assert got.tolist() == slow_schedule(conf.tolist(), sps), (conf, sps)
        assert got.dtype == torch.long and int(got.min()) >= 1 and int(got.max()) <= gamma + 1


def test_bad_input_raises():
    with pytest.raises(ValueError, match="requests, gamma"):
        schedule(torch.rand(7), FLAT)
    with pytest.raises(ValueError, match="requests, gamma"):
        schedule(torch.ones(2, 3, dtype=torch.long), FLAT)
    with pytest.raises(ValueError, match="SPS table"):
        schedule(torch.rand(2, 3), None)
    with pytest.raises(ValueError, match="unknown schedule policy"):
        schedule(torch.rand(2, 3), FLAT, "greedy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    conf = torch.rand(64, 7, device="cuda")
    sps = SpsTable([1, 64, 256, 512], [100.0, 90.0, 50.0, 20.0])
    schedule(conf, sps)  # first call copies the table to the device (once)
    torch.cuda.set_sync_debug_mode("error")
    try:
        lengths = schedule(conf, sps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert lengths.device.type == "cuda"
    assert lengths.tolist() == schedule(conf.cpu(), sps).tolist()


def test_planner_applies_sts_then_schedules():
    logits = torch.tensor([[4.0, 4.0, -4.0]])  # confidences 0.98, 0.98, 0.02
    prop = Proposal(
        tokens=torch.zeros(1, 3, dtype=torch.long), logits=torch.zeros(1, 3, 5), conf_logits=logits
    )
    sps = SpsTable([1, 2, 3, 4], [1.0, 0.9, 0.65, 0.5])
    assert ConfidencePlanner(sps)(prop).tolist() == [3]  # Theta: 1, 1.78, 1.91, 1.48
    # T_2 = 40 turns c_2 into sigmoid(0.1) = 0.52: Theta 1, 1.78, 1.62 -> only the first draft
    assert ConfidencePlanner(sps, torch.tensor([1.0, 40.0, 1.0]))(prop).tolist() == [2]
    assert ConfidencePlanner(None, policy="static")(prop).tolist() == [4]
    with pytest.raises(ValueError, match="confidence head"):
        ConfidencePlanner(sps)(Proposal(prop.tokens, prop.logits, None))
    with pytest.raises(ValueError, match="SPS table"):
        ConfidencePlanner(None)
    with pytest.raises(ValueError, match="unknown schedule policy"):
        ConfidencePlanner(sps, policy="all")


# --- Losslessness: a toy speculative decoder whose verify length depends on the drafted tokens ------------
# Target and draft are Markov chains over 3 tokens; the "confidence head" is a fixed function of the
# previous token, c_k = G[x_{k-1}], so c_{k+1} depends on the draft token x_k. From anchor 2 (c_1 = 0.5)
# Theta_1 = 1.5 * 0.6 < Theta_0 = 1, so the paper's rule verifies nothing; peek-ahead sees Theta_2 > 1 exactly
# when x_1 = 0 (c_2 = 0.9), so it tests x_1 only when x_1 = 0 and the first token comes out as 0 with
# probability Q(0)·min(1, P(0)/Q(0)) + (1 - Q(0))·P(0) = 0.45 instead of P(0) = 0.3. Our look-ahead verifies x_1
# whatever it is (its bound, 2.5 * 0.5 > 1, reads c_1 only) and how far it goes on depends on x_1, which the
# exact scheduler must handle.
P = torch.tensor([[0.5, 0.2, 0.3], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)
Q = torch.tensor([[0.6, 0.2, 0.2], [0.3, 0.4, 0.3], [0.5, 0.25, 0.25]], dtype=torch.float64)
G = torch.tensor([0.9, 0.1, 0.5], dtype=torch.float64)
TOY_SPS = SpsTable([1, 2, 3, 4], [1.0, 0.6, 0.55, 0.5])
# Two requests: a table falling all the way to 8 tokens, so the look-ahead's lengths (1 to 4) depend on the drafts
BATCH_SPS = SpsTable([2, 3, 4, 5, 6, 7, 8], [1.0, 0.75, 0.6, 0.55, 0.45, 0.3, 0.25])
GAMMA, OUT_LEN = 3, 3


def per_scene_lengths(conf, scheduler, sps=TOY_SPS):
    """Run the scheduler once per distinct scene (it is a pure function of the confidences)."""
    flat = conf.reshape(conf.shape[0], -1)
    uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
    lengths = torch.stack([scheduler(u.view(conf.shape[1:]), sps) for u in uniq])
    return lengths[inverse]


def simulate(scheduler, anchors, seed, rule="rejection", sps=TOY_SPS):
    """anchors [N, R]: N independent scenes of R requests scheduled together. Returns the first OUT_LEN
    generated tokens of every request [N, R, OUT_LEN] and the verify lengths used at each step."""
    gen = torch.Generator().manual_seed(seed)
    n, num_req = anchors.shape
    anchor = anchors.reshape(-1)
    out = torch.zeros(n * num_req, OUT_LEN + GAMMA + 1, dtype=torch.long)
    count = torch.zeros(n * num_req, dtype=torch.long)
    used = []
    for _ in range(OUT_LEN):  # every step commits at least one token
        tokens = [anchor]
        for _ in range(GAMMA):
            tokens.append(torch.multinomial(Q[tokens[-1]], 1, generator=gen).squeeze(1))
        seq = torch.stack(tokens, 1)  # [N*R, 1 + gamma]: anchor, x_1..x_gamma
        conf = G[seq[:, :GAMMA]].view(n, num_req, GAMMA)
        lengths = per_scene_lengths(conf, scheduler, sps).reshape(-1)
        used.append(lengths)
        res = ACCEPT_RULES[rule](seq[:, 1:], Q[seq[:, :GAMMA]], P[seq], lengths - 1, gen)
        accepted, bonus = res.num_accepted, res.bonus
        step_tokens = torch.cat([seq[:, 1:], torch.zeros_like(bonus[:, None])], 1)
        step_tokens[torch.arange(len(bonus)), accepted] = bonus
        for j in range(GAMMA + 1):
            keep = (j <= accepted) & (count < OUT_LEN)
            out[keep, count[keep] + j] = step_tokens[keep, j]
        count += accepted + 1
        anchor = bonus
    return out[:, :OUT_LEN].view(n, num_req, OUT_LEN), torch.cat(used)


def chi_square_pvalue(samples, anchors):
    """Chi-square of observed continuations [N, R, T] (jointly over the R requests) against the target
    chain from each request's anchor."""
    n, num_req, length = samples.shape
    cells = list(itertools.product(range(3), repeat=num_req * length))
    codes = (samples.reshape(n, -1) * 3 ** torch.arange(num_req * length - 1, -1, -1)).sum(1)
    observed = torch.bincount(codes, minlength=len(cells)).double()
    expected = torch.ones(len(cells), dtype=torch.float64)
    for code, cell in enumerate(cells):
        for r, anchor in enumerate(anchors):
            path = (anchor, *cell[r * length : (r + 1) * length])
            expected[code] *= math.prod(P[a, b] for a, b in itertools.pairwise(path))
    return chisquare(observed.numpy(), (expected * n).numpy()).pvalue


@pytest.mark.parametrize("rule", ["rejection", "block"])
def test_early_stop_is_lossless_and_peek_ahead_is_not(rule):
    anchors = torch.full((20000, 1), 2)
    exact, lengths = simulate(confidence_verify_lengths, anchors, seed=0, rule=rule)
    assert set(lengths.tolist()) == {1, 2, 3, 4}  # the verify length really depends on the drafts
    assert chi_square_pvalue(exact, [2]) > 1e-3
    peek, _ = simulate(peek_ahead_lengths, anchors, seed=0, rule=rule)
    assert chi_square_pvalue(peek, [2]) < 1e-12
    if rule == "rejection":
        assert (peek[:, 0, 0] == 0).double().mean() == pytest.approx(0.45, abs=0.015)


def test_batched_requests_stay_lossless_jointly():
    """Two requests ranked together, so each one's verify length also depends on the other's drafts;
    the pair of 2-token continuations must still follow the target (81 cells)."""
    anchors = torch.tensor([[1, 1]]).repeat(20000, 1)
    exact, lengths = simulate(confidence_verify_lengths, anchors, seed=1, sps=BATCH_SPS)
    assert {1, 2, 3, 4} <= set(lengths.tolist())
    assert chi_square_pvalue(exact[..., :2], [1, 1]) > 1e-3
    peek, _ = simulate(peek_ahead_lengths, anchors, seed=1)  # on the toy table, where peeking is known to bias
    assert chi_square_pvalue(peek[..., :2], [1, 1]) < 1e-12


# --- The padded rule: one width for a batch whose verify costs SPS(R x width) ------------------------------------


def slow_padded(conf, sps):
    """Column by column, by brute force over every wider window: column d joins while some width m > d, counting
    columns d..m-1 at column d's summed survival, beats the throughput with d columns."""
    num_req, gamma = len(conf), len(conf[0])
    survival = [[math.prod(max(0.0, min(1.0, c)) for c in row[: j + 1]) for j in range(gamma)] for row in conf]
    column = [sum(survival[r][d] for r in range(num_req)) for d in range(gamma)]
    tau, d = float(num_req), 0
    while d < gamma:
        best = max((tau + (m - d) * column[d]) * sps(num_req * (m + 1)) for m in range(d + 1, gamma + 1))
        if not best > tau * sps(num_req * (d + 1)):
            break
        tau, d = tau + column[d], d + 1
    return [d + 1] * num_req


def test_padded_matches_the_loop_reference_on_random_inputs():
    for conf, sps in random_cases(1):
        gamma = conf.shape[1]
        got = padded_verify_lengths(conf, sps)
        assert got.tolist() == slow_padded(conf.tolist(), sps), (conf, sps)
        assert got.dtype == torch.long and 1 <= int(got.min()) == int(got.max()) <= gamma + 1
    assert padded_verify_lengths(torch.zeros(3, 0), FLAT).tolist() == [1, 1, 1]
    assert schedule(torch.full((2, 3), 0.9), FLAT, padded=True).tolist() == [4, 4]


def test_padded_gives_the_whole_window_to_every_row_it_pays_for():
    """One confident request among four: the per-request rule verifies [8, 1, 1, 1], which a padded verify runs
    as 4 x 8 tokens anyway; the padded rule weighs that cost: on a table where 32 tokens cost 4x one token it stops
    at the width the four rows' summed survivals pay for, and gives every row that width."""
    conf = torch.tensor([[0.99] * 7, [0.3] * 7, [0.3] * 7, [0.3] * 7])
    steep = SpsTable([4, 8, 12, 16, 20, 24, 28, 32], [100.0, 80.0, 66.0, 57.0, 50.0, 40.0, 33.0, 25.0])
    assert confidence_verify_lengths(conf, steep).tolist() == [8, 1, 1, 1]
    got = padded_verify_lengths(conf, steep)
    assert got.tolist() == slow_padded(conf.tolist(), steep)
    w = int(got[0])

    def rate(width):  # expected committed tokens per second when all four rows verify `width`
        a = conf.double().cumprod(1)[:, : width - 1].sum()
        return float((4 + a) * steep(4 * width))

    assert 1 < w < 8 and rate(w) > rate(8)  # the per-request rule's padded cost is the full window


def test_reference_planner_pads_like_its_verify():
    """The reference engine verifies every row at the batch's longest length, so its planner schedules one width
    (the padded rule) unless told the verify is ragged."""
    conf = torch.tensor([[0.99] * 7, [0.3] * 7, [0.3] * 7, [0.3] * 7])
    steep = SpsTable([4, 8, 12, 16, 20, 24, 28, 32], [100.0, 80.0, 66.0, 57.0, 50.0, 40.0, 33.0, 25.0])
    prop = Proposal(tokens=torch.zeros(4, 7, dtype=torch.long), logits=torch.zeros(4, 7, 5),
                    conf_logits=torch.logit(conf))
    padded = ConfidencePlanner(steep)(prop)
    assert padded.tolist() == padded_verify_lengths(conf, steep).tolist() and len(set(padded.tolist())) == 1
    assert ConfidencePlanner(steep, padded=False)(prop).tolist() == [8, 1, 1, 1]


def test_padded_column_decisions_read_no_later_column():
    """Exactness: whether column d is verified must not depend on the confidences of columns > d (those read the
    draft tokens of columns >= d, which are under test)."""
    gen = torch.Generator().manual_seed(2)
    sps = SpsTable([1, 4, 8, 16, 24, 32], [100.0, 90.0, 70.0, 60.0, 35.0, 30.0])
    for _ in range(200):
        conf = torch.rand(4, 7, generator=gen)
        d = int(torch.randint(0, 7, (1,), generator=gen))
        other = conf.clone()
        other[:, d + 1 :] = torch.rand(4, 6 - d, generator=gen)
        verified = padded_verify_lengths(conf, sps) >= d + 2  # draft column d (0-based) is in the window
        assert torch.equal(verified, padded_verify_lengths(other, sps) >= d + 2)


def test_padded_batched_requests_stay_lossless_jointly():
    anchors = torch.tensor([[1, 1]]).repeat(20000, 1)
    exact, lengths = simulate(padded_verify_lengths, anchors, seed=3, sps=BATCH_SPS)
    assert len(set(lengths.tolist())) > 1  # the width depends on the drafts
    assert chi_square_pvalue(exact[..., :2], [1, 1]) > 1e-3
