"""Lossless at T = 0: DSpark output is token-identical to plain greedy decoding of the target (fp32)."""

import pytest
import torch

from dspark_sgl.model import DSparkDraft
from dspark_sgl.speculative.engine import SpecEngine
from dspark_sgl.targets import HFTarget
from tests.conftest import draft_config_for, tiny_llama

PROMPTS = [[5, 9, 3, 17, 2], [40, 41], [7, 7, 7, 30, 31, 32, 33, 8], [12]]


def bigram_draft(draft: DSparkDraft, pairs: list[tuple[int, int]], scale: float = 30.0) -> DSparkDraft:
    """A deliberately good draft: base logits zeroed (norm weight 0), the Markov head holds a bigram table.

    Each previous token gets its own one-hot latent, so the table is exact for up to `markov_rank` tokens.
    """
    prev_ids = sorted({p for p, _ in pairs})
    assert len(prev_ids) <= draft.config.markov_rank
    mh = draft.markov_head
    with torch.no_grad():
        draft.norm.weight.zero_()
        mh.markov_w1.weight.zero_()
        mh.markov_w2.weight.zero_()
        for i, p in enumerate(prev_ids):
            mh.markov_w1.weight[p, i] = 1.0
        for p, n in pairs:
            mh.markov_w2.weight[:, prev_ids.index(p)] = 0.0
            mh.markov_w2.weight[n, prev_ids.index(p)] = scale
    return draft


def pairs_from(prompts, outputs):
    pairs = []
    for p, o in zip(prompts, outputs, strict=True):
        seq = p + o
        pairs += list(zip(seq[len(p) - 1 : -1], seq[len(p) :], strict=True))
    return pairs


def chain_accepts(table: dict[int, int], out: list[int], gamma: int, default: int = 0) -> list[int]:
    """The accepted counts a bigram oracle MUST get at T = 0: each step drafts the table's chain from the anchor
    (`default` after a token outside the table: all-zero logits pick the first draft-vocabulary id) and accepts its
    leading matches with the output."""
    accepted, i = [], 0
    while i < len(out) - 1:
        prev, c = out[i], 0
        while c < gamma and i + 1 + c < len(out):
            prev = table.get(prev, default)
            if prev != out[i + 1 + c]:
                break
            c += 1
        accepted.append(c)
        i += c + 1
    return accepted


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_random_draft_is_lossless_on_tiny_target(batch, block_size):
    target = HFTarget(tiny_llama(), [0, 2])
    prompts = PROMPTS[:batch]
    ref = SpecEngine(target).generate(prompts, 20)
    torch.manual_seed(1)
    draft = DSparkDraft(draft_config_for(target, block_size=block_size, markov_head_type="rnn",
                                         anchor_state=batch == 4))  # the a-1 path through the engine's cache
    if batch == 4:
        with torch.no_grad():
            draft.anchor_proj.weight.normal_(0, 0.5)
    out = SpecEngine(target, draft).generate(prompts, 20)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert all(len(o.token_ids) == 20 for o in out)


def test_plain_engine_equals_transformers_generate():
    model = tiny_llama()
    target = HFTarget(model, [1])
    out = SpecEngine(target).generate(PROMPTS[:2], 15)
    for p, o in zip(PROMPTS[:2], out, strict=True):
        ref = model.generate(torch.tensor([p]), max_new_tokens=15, do_sample=False, min_new_tokens=15)
        assert o.token_ids == ref[0, len(p):].tolist()


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_good_draft_is_lossless_and_accepts_long_runs(kind):
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 24)
    cfg = draft_config_for(target, block_size=5, markov_rank=64, markov_head_type=kind)
    draft = bigram_draft(DSparkDraft(cfg), pairs_from(PROMPTS, [r.token_ids for r in ref]))
    if kind == "gated":  # open the gate fully: latent = σ(big) · e
        with torch.no_grad():
            draft.markov_head.gate_proj.weight.zero_()
            draft.markov_head.gate_proj.bias.fill_(20.0)
    out = SpecEngine(target, draft).generate(PROMPTS, 24)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    # every step accepts exactly the chain the bigram table drafts (the last step: max_new_tokens may cut it)
    table = dict(pairs_from(PROMPTS, [r.token_ids for r in ref]))
    assert [o.stats.accepted[:-1] for o in out] == [chain_accepts(table, r.token_ids, 5)[: len(o.stats.accepted) - 1]
                                                    for o, r in zip(out, ref, strict=True)]
    assert max(max(o.stats.accepted) for o in out) == 5  # full blocks were accepted
    # ragged acceptance really happened across the batch
    assert len({tuple(o.stats.accepted) for o in out}) > 1


def test_eos_stops_each_request_and_stats_add_up():
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 30)
    eos = ref[0].token_ids[6]  # a token the first request emits early
    draft = DSparkDraft(draft_config_for(target))
    out = SpecEngine(target, draft).generate(PROMPTS, 30, eos_token_ids={eos})
    plain = SpecEngine(target).generate(PROMPTS, 30, eos_token_ids={eos})
    assert [o.token_ids for o in out] == [p.token_ids for p in plain]
    assert out[0].finished and out[0].token_ids[-1] == eos and len(out[0].token_ids) <= 7
    for o in out:
        s = o.stats
        assert sum(s.accept_hist) == s.steps
        assert len(s.per_position_accept) == 4
        assert all(a >= b for a, b in zip(s.per_position_accept, s.per_position_accept[1:], strict=False))


def test_draft_for_another_target_is_refused():
    target = HFTarget(tiny_llama(), [0, 2])
    with pytest.raises(ValueError, match="hidden size"):
        SpecEngine(target, DSparkDraft(draft_config_for(target, hidden_size=64)))
    with pytest.raises(ValueError, match="expects \\[0, 1\\]"):
        SpecEngine(target, DSparkDraft(draft_config_for(target, target_layer_ids=[0, 1])))
    with pytest.raises(ValueError, match="at least one token"):
        SpecEngine(target).generate([[]], 4)


@pytest.mark.smollm2
def test_smollm2_lossless_random_and_good_draft(smollm2_dir):
    from transformers import AutoTokenizer

    from dspark_sgl.config import DSparkConfig, default_target_layer_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = default_target_layer_ids(30, 3)
    target = HFTarget.from_pretrained(smollm2_dir, ids)
    questions = ["What is 7 times 8?", "Name a planet.", "Write one sentence about cats."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    eos = {tok.eos_token_id}
    ref = SpecEngine(target).generate(prompts, 32, eos_token_ids=eos)
    cfg = DSparkConfig(hidden_size=576, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, intermediate_size=512, vocab_size=49152, target_layer_ids=ids,
                       num_target_layers=30, mask_token_id=16, markov_rank=256, rope_theta=100000.0)
    torch.manual_seed(0)
    random_out = SpecEngine(target, DSparkDraft(cfg)).generate(prompts, 32, eos_token_ids=eos)
    assert [o.token_ids for o in random_out] == [r.token_ids for r in ref]
    good = bigram_draft(DSparkDraft(cfg), pairs_from(prompts, [r.token_ids for r in ref]))
    good_out = SpecEngine(target, good).generate(prompts, 32, eos_token_ids=eos)
    assert [o.token_ids for o in good_out] == [r.token_ids for r in ref]
    table = dict(pairs_from(prompts, [r.token_ids for r in ref]))
    assert [o.stats.accepted[:-1] for o in good_out] == [
        chain_accepts(table, r.token_ids, cfg.block_size)[: len(o.stats.accepted) - 1]
        for o, r in zip(good_out, ref, strict=True)]


def steep_sps(max_tokens: int = 1 << 15):
    """A verify cost that grows with tokens, so the confidence scheduler really cuts blocks short."""
    from dspark_sgl.speculative.sps import SpsTable

    tokens = [1 << i for i in range(16) if 1 << i <= max_tokens]
    return SpsTable(tokens, [1000.0 / (1 + n / 4) for n in tokens])


def test_confidence_schedule_is_lossless_at_t0_and_verifies_less():
    from dspark_sgl.speculative.scheduler import ConfidencePlanner

    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 24)
    cfg = draft_config_for(target, block_size=5, markov_rank=64)
    draft = bigram_draft(DSparkDraft(cfg), pairs_from(PROMPTS, [r.token_ids for r in ref]))
    with torch.no_grad():  # confidence from the Markov embedding only: high after known tokens
        draft.confidence_head.proj.weight.normal_(0, 1.0)
    static = SpecEngine(target, draft).generate(PROMPTS, 24)
    sched = SpecEngine(target, draft, ConfidencePlanner(steep_sps())).generate(PROMPTS, 24)
    assert [o.token_ids for o in sched] == [r.token_ids for r in ref]
    verified_static = sum(sum(o.stats.verified) for o in static)
    verified_sched = sum(sum(o.stats.verified) for o in sched)
    assert verified_sched < verified_static
    assert all(c <= v for o in sched for c, v in zip(o.stats.accepted, o.stats.verified, strict=True))
