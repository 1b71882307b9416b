"""The one definition of the distribution the target samples from (speculative/target_dist.py), checked against
SGLang 0.5.23's semantics, and the engine's served distribution under every parameter (chi-square, fixed seeds,
a planted bug that must fail)."""

import pytest
import torch

from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.target_dist import BatchSampling, OutputHistory, RequestSampling, target_dist
from tests.conftest import tiny_with_random_draft
from tests.test_sampling import chi2_pvalue


def dist(logits, req: RequestSampling, history=None, drafts=None, joint=True):
    s = BatchSampling.from_requests([req], logits.shape[-1], "cpu", joint)
    return target_dist(logits.view(1, -1, logits.shape[-1]), s, history, drafts)[0]


def test_top_k_and_top_p_are_judged_jointly_on_the_softmax():
    """probs [.4, .3, .3], k = 2, p = 0.5: the torch Sampler keeps {0, 1} (top-p on the original mass); re-normalising
    after top-k first (FlashInfer's order with min-p) keeps {0} only."""
    logits = torch.tensor([0.4, 0.3, 0.3]).log()
    req = RequestSampling(temperature=1.0, top_k=2, top_p=0.5)
    assert torch.allclose(dist(logits, req)[0], torch.tensor([4 / 7, 3 / 7, 0.0]))
    assert torch.allclose(dist(logits, req, joint=False)[0], torch.tensor([1.0, 0.0, 0.0]))


def test_top_p_keeps_a_token_while_the_mass_before_it_is_at_most_p():
    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    assert (dist(logits, RequestSampling(temperature=1.0, top_p=0.5))[0] > 0).tolist() == [True, True, False]


def test_min_p_is_relative_to_the_largest_probability():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    p = dist(logits, RequestSampling(temperature=1.0, min_p=0.35))[0]  # threshold 0.175
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_penalties_follow_sglang_order_and_see_earlier_drafts():
    """Additive (frequency·count, presence) first, then repetition (x<0: x·r, else x/r), then logit bias; column j
    counts the history plus drafts x_1..x_j; min_new_tokens holds stop tokens back while the output is short."""
    V = 4
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]] * 3)
    req = RequestSampling(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                          logit_bias={3: 1.0}, min_new_tokens=3, stop_token_ids=frozenset({2}))
    hist = OutputHistory.from_lists([[0, 0]], V, "cpu")  # output so far: token 0 twice (the anchor included)
    s = BatchSampling.from_requests([req], V, "cpu")
    from dspark_sgl.speculative.target_dist import adjust_logits

    x = adjust_logits(logits[None], s, hist, torch.tensor([[1, 1]]))[0]
    t0 = (1.0 - 0.5 * 2 - 0.25) * 2  # -0.25 < 0: scaled up by r
    assert x[0].tolist() == pytest.approx([t0, -1.0, float("-inf"), 1.5])  # output length 2 < 3: stop token held
    t1 = (-1.0 - 0.5 - 0.25) * 2
    assert x[1].tolist() == pytest.approx([t0, t1, 2.0, 1.5])  # length 3: token 2 free; x_1 = 1 now counted
    assert x[2, 1] == pytest.approx((-1.0 - 1.0 - 0.25) * 2)


def test_greedy_rows_are_the_argmax_of_the_adjusted_logits():
    logits = torch.tensor([3.0, 2.9, 0.0])
    req = RequestSampling(temperature=0.0, logit_bias={1: 0.2})
    assert dist(logits, req)[0].tolist() == [0.0, 1.0, 0.0]
    assert RequestSampling(temperature=0.8, top_k=1).greedy  # SGLang's greedy is top_k = 1


@pytest.mark.parametrize("field,value", [("top_p", 0.0), ("top_p", 1.5), ("temperature", -1.0), ("min_p", 2.0),
                                         ("repetition_penalty", 0.0), ("frequency_penalty", 3.0), ("top_k", 0)])
def test_out_of_range_values_are_one_clear_error(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        RequestSampling(**{field: value}).validate(8)


# ---- the engine's served distribution, exact enumeration of the first three tokens -------------------------------
V = 6
PROMPT = [1, 2, 3]
PARAMS = {
    "T=0.7": dict(temperature=0.7),
    "top-k 3 + top-p 0.7": dict(temperature=1.0, top_k=3, top_p=0.7),
    "min-p 0.2": dict(temperature=1.0, min_p=0.2),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4),
    "logit bias": dict(temperature=1.0, logit_bias={0: 1.5, 4: -2.0}),
    "min_new_tokens": dict(temperature=1.0, min_new_tokens=2, stop_token_ids=frozenset({2})),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_with_random_draft(V)


def exact_joint(model, req: RequestSampling) -> torch.Tensor:
    """P(t1, t2, t3) by enumeration with the shared definition (history = the output so far)."""
    probs = torch.zeros(V, V, V)
    with torch.no_grad():
        def p(out):
            logits = model(torch.tensor([PROMPT + out])).logits[0, -1]
            return dist(logits, req, OutputHistory.from_lists([out], V, "cpu"))[0]
        p1 = p([])
        for a in range(V):
            p2 = p([a])
            for b in range(V):
                probs[a, b] = p1[a] * p2[b] * p([a, b])
    return probs.flatten()


def served_counts(engine, requests, n, acceptance="rejection", seed=7):
    out = engine.generate([PROMPT] * n, 3, SamplingConfig(acceptance=acceptance, seed=seed), requests=requests)
    seqs = torch.tensor([o.token_ids for o in out])
    return torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V**3), out


@pytest.mark.parametrize("name", list(PARAMS))
def test_engine_samples_the_target_distribution_under_each_parameter(tiny, name):
    model, target, draft = tiny
    req = RequestSampling(**PARAMS[name])
    exact = exact_joint(model, req)
    n = 4000
    counts, out = served_counts(SpecEngine(target, draft), [req] * n, n, "block" if "bias" in name else "rejection")
    assert chi2_pvalue(counts, exact) > 1e-3, name
    assert counts[exact == 0].sum() == 0  # filtered or held-back tokens never appear
    assert sum(sum(o.stats.accepted) for o in out) > 0.1 * n  # drafts really accepted


def test_a_dropped_penalty_is_caught(tiny):
    """The planted bug the issue found in the worker: verify without the penalties. The test must fail on it."""
    model, target, draft = tiny
    with_pen = RequestSampling(**PARAMS["penalties"])
    counts, _ = served_counts(SpecEngine(target, draft), [RequestSampling(temperature=1.0)] * 4000, 4000)
    assert chi2_pvalue(counts, exact_joint(model, with_pen)) < 1e-6


def test_mixed_batch_greedy_rows_are_exact_and_sampled_rows_keep_their_distribution(tiny):
    """One batch, rows with different parameters: greedy rows (with and without penalties) equal their greedy
    decoding alone; each sampled kind keeps its exact distribution."""
    model, target, draft = tiny
    greedy = [RequestSampling(), RequestSampling(repetition_penalty=1.5, frequency_penalty=0.5)]
    kinds = [RequestSampling(**PARAMS["T=0.7"]), RequestSampling(**PARAMS["penalties"])]
    n = 3000
    reqs = greedy + [kinds[i % 2] for i in range(2 * n)]
    out = SpecEngine(target, draft).generate([PROMPT] * len(reqs), 3, SamplingConfig(seed=5), requests=reqs)
    for g, o in zip(greedy, out, strict=False):
        alone = SpecEngine(target).generate([PROMPT], 3, requests=[g])[0]
        assert o.token_ids == alone.token_ids
    for k, kind in enumerate(kinds):
        seqs = torch.tensor([o.token_ids for o in out[2 + k :: 2]])
        counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V**3)
        assert chi2_pvalue(counts, exact_joint(model, kind)) > 1e-3


def test_a_seeded_request_gives_the_same_output_whatever_else_is_in_the_batch(tiny):
    _, target, draft = tiny
    seeded = RequestSampling(temperature=1.0, sampling_seed=1234)
    others = [RequestSampling(temperature=0.9), RequestSampling(), RequestSampling(temperature=1.0, top_k=2)]
    engine = SpecEngine(target, draft)
    alone = engine.generate([PROMPT], 12, SamplingConfig(seed=1), requests=[seeded])[0].token_ids
    mixed = engine.generate([[4, 5], PROMPT, [2]], 12, SamplingConfig(seed=2), requests=[others[0], seeded, others[2]])
    assert mixed[1].token_ids == alone
    unseeded = [engine.generate([PROMPT], 12, SamplingConfig(seed=s), requests=[others[0]])[0].token_ids
                for s in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # without a seed the generator decides (the test can fail)
