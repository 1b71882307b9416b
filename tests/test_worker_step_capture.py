"""The SGLang worker's decode step minus SGLang's own verify forward — context gather, draft block, Markov rollout,
confidence schedule, rank 0's decisions shared over TP (a no-op at one rank), acceptance, context commit — the calls
`DSparkWorker._forward_decode` makes, in its order:

- reads no device value on the host (benchmarks/step_counter.py counts none), greedy and sampled, static and
  confidence schedule, full and reduced draft vocabulary;
- compiles with `torch.compile(fullgraph=True, dynamic=False)` per batch-size bucket (no graph break: the step is
  capturable) and equals eager to the bit in fp32 (aot_eager: the same aten ops, traced once per shape), for a
  full-vocabulary draft.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.sglang.context import DraftContextPool
from dspark_sgl.sglang.planning import VerifyPlanner
from dspark_sgl.sglang.ranks import RankSync
from dspark_sgl.sglang.sampling import SlotTokens
from dspark_sgl.speculative.rows import accept_rows, propose, step_noise
from dspark_sgl.speculative.scheduler import FullCostRule, RuleConfig
from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.target_dist import BatchSampling, RequestSampling, adjust_logits
from tests.conftest import tiny_draft_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counter import StepCounter  # noqa: E402

V, GAMMA, SLOTS, MAX_LEN = 96, 4, 256, 40


def make_draft(vocab: str) -> DSparkDraft:
    torch.manual_seed(0)
    over = {"draft_vocab_size": 48} if vocab == "reduced" else {}
    c = tiny_draft_config(block_size=GAMMA, **over)
    draft = DSparkDraft(c)
    if vocab == "reduced":
        with torch.no_grad():
            draft.d2t.copy_(torch.arange(0, V, 2) - torch.arange(48))  # the even target ids
    heads = (torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size))
    return draft.eval().bind_target(*heads)


def make_rows(mode: str, B: int) -> BatchSampling:
    if mode == "greedy":
        reqs = [RequestSampling() for _ in range(B)]
    else:  # sampled rows with filters and a seed, and a greedy row: one mixed batch
        reqs = [RequestSampling(temperature=0.8, top_p=0.9, top_k=20, sampling_seed=b if b % 2 else None)
                for b in range(B)]
        reqs[0] = RequestSampling()
    return BatchSampling.from_requests(reqs, V, "cpu")


def planner(schedule: str) -> VerifyPlanner:
    p = VerifyPlanner(schedule, GAMMA, FullCostRule(GAMMA, config=RuleConfig(mode="on")))
    if schedule == "confidence":  # verify cost steep in tokens: the schedule trims
        p.sps = SpsTable(list(range(1, 64)), [100.0 / t for t in range(1, 64)])
    return p


def decode_step(draft, pool, slot_tokens, plan, rows, generator, req_to_token, pool_idx, seq_lens, longest, anchor,
                target_logits, aux, loc, positions, ranks=RankSync()):
    """What DSparkWorker._forward_decode runs around SGLang's verify (target_logits/aux stand in for its output, which
    TP's lm_head all-gather makes the same on every rank)."""
    B, W = anchor.shape[0], GAMMA + 1
    noise = step_noise(rows, generator, seq_lens)
    ctx = pool.gather(req_to_token, pool_idx, seq_lens, longest)
    h = draft.forward_step(anchor, ctx)
    prop = propose(draft, h, anchor, rows, noise)
    lengths = plan.verify_lengths(prop.conf_logits, B, anchor.device)
    prop.tokens, lengths = ranks.share(prop.tokens, lengths)
    verify_ids = torch.cat((anchor[:, None], prop.tokens), 1)
    logits = adjust_logits(target_logits, rows, None, prop.tokens)
    acc = accept_rows(prop, logits, rows, lengths - 1, noise, "rejection")
    c, bonus = ranks.share(acc.num_accepted, acc.bonus)
    cols = torch.arange(W, device=anchor.device)[None]
    keep = (cols <= c[:, None]).reshape(-1)
    pool.write(loc, aux, positions, keep)
    slot_tokens.write(loc, verify_ids.reshape(-1), keep)
    return prop.tokens, prop.logits, lengths, c, bonus, seq_lens + c + 1


def inputs(draft: DSparkDraft, B: int, seed: int = 1):
    """A batch mid-decode: requests with committed context in the pool, a verify window of fresh slots each."""
    g = torch.Generator().manual_seed(seed)
    W = GAMMA + 1
    seq_lens = torch.randint(5, MAX_LEN - W, (B,), generator=g)
    req_to_token = torch.arange(1, 1 + B * MAX_LEN).view(B, MAX_LEN)  # slot 0 is SGLang's padding slot
    pool = DraftContextPool(draft, SLOTS, "cpu", torch.float32)
    aux_dim = draft.config.num_aux * draft.config.hidden_size
    for b in range(B):
        n = int(seq_lens[b])
        pool.write(req_to_token[b, :n], torch.randn(n, aux_dim, generator=g), torch.arange(n))
    pos = seq_lens[:, None] + torch.arange(W)
    loc = req_to_token.gather(1, pos).reshape(-1)
    return dict(pool=pool, req_to_token=req_to_token, pool_idx=torch.arange(B), seq_lens=seq_lens,
                longest=int(seq_lens.max()), anchor=torch.randint(0, V, (B,), generator=g),
                target_logits=torch.randn(B, W, V, generator=g) * 3, aux=torch.randn(B * W, aux_dim, generator=g),
                loc=loc, positions=pos.reshape(-1))


def run(step, draft, plan, rows, x, own_generator: bool = True, ranks: RankSync | None = None):
    """One step from a copy of the pool. own_generator=False draws from torch's global generator (reseeded) instead
    of a torch.Generator object, which Dynamo cannot trace (a captured step draws its uniforms outside the graph)."""
    pool = DraftContextPool(draft, SLOTS, "cpu", torch.float32)
    pool.k.copy_(x["pool"].k), pool.v.copy_(x["pool"].v)
    slot_tokens = SlotTokens(SLOTS, "cpu")
    args = {k: v for k, v in x.items() if k != "pool"}
    torch.manual_seed(7)
    generator = torch.Generator().manual_seed(7) if own_generator else None
    out = step(draft, pool, slot_tokens, plan, rows, generator, **args, **({"ranks": ranks} if ranks else {}))
    return (*out, pool.k.clone(), pool.v.clone(), slot_tokens.ids.clone())


CASES = [(mode, schedule, vocab) for mode in ("greedy", "sampled") for schedule in ("static", "confidence")
         for vocab in ("full", "reduced")]


@pytest.mark.parametrize("mode,schedule,vocab", CASES)
@torch.no_grad()
def test_the_step_reads_no_device_value_on_the_host(mode, schedule, vocab):
    draft, plan = make_draft(vocab), planner(schedule)
    for B in (1, 4):
        x, rows = inputs(draft, B), make_rows(mode, B)
        run(decode_step, draft, plan, rows, x)  # warm: one-time host work (SPS table to the device) happens here
        x["seq_lens"] = x["seq_lens"].clone()  # device-side; the host knows only `longest` (SGLang's seq_lens_cpu)
        with StepCounter() as counter, counter.wrapped_reads():
            out = run(decode_step, draft, plan, rows, x)
        assert counter.num_syncs() == 0, dict(counter.syncs["worker"])
        lengths, c = out[2], out[3]
        assert bool((c <= lengths - 1).all()) and bool((lengths >= 1).all())
        if schedule == "confidence":
            assert int(lengths.max()) < GAMMA + 1 or int(lengths.min()) == GAMMA + 1  # the schedule ran


def test_the_counter_sees_the_syncs_this_step_avoids():
    """Planted: the width read off the device lengths (the old gather) and a boolean-mask commit are counted."""
    draft = make_draft("full")
    x = inputs(draft, 2)
    with StepCounter() as counter, counter.wrapped_reads():
        x["pool"].gather(x["req_to_token"], x["pool_idx"], x["seq_lens"])  # no host width: int(max)
        keep = x["loc"] >= 0  # a device-side mask
        x["pool"].write(x["loc"][keep], x["aux"][keep], x["positions"][keep])
    assert counter.syncs["worker"] == {"_local_scalar_dense.default": 1, "index.Tensor": 3}


# Full vocabulary only: a reduced-vocabulary draft checks its cached hot lm_head rows by data pointer inside the step
# (DSparkDraft.head_weight), which Dynamo cannot trace; a captured step would check that key before capture.
@pytest.mark.parametrize("mode,schedule", [("greedy", "static"), ("sampled", "confidence")])  # ~15 s each
@torch.no_grad()
def test_the_step_compiles_whole_per_batch_bucket_and_equals_eager_to_the_bit(mode, schedule):
    torch._dynamo.reset()
    draft, plan = make_draft("full"), planner(schedule)
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, backend="aot_eager")
    for B in (1, 4):  # one graph per bucket
        x, rows = inputs(draft, B, seed=B), make_rows(mode, B)
        eager = run(decode_step, draft, plan, rows, x, own_generator=False)
        graph = run(compiled, draft, plan, rows, x, own_generator=False)
        for a, b in zip(eager, graph, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
