"""Every TP rank commits rank 0's decisions (dspark_sgl/sglang/ranks.py), on two gloo processes on the CPU.

Each process runs the worker's decode step (tests/test_worker_step_capture.py's `decode_step`, the calls
`DSparkWorker._forward_decode` makes around SGLang's verify) on the same target logits and hidden states, which the
lm_head all-gather makes identical under TP, but rank 1's draft has other weights (a rank that drafts with another
seed), for greedy and sampled rows, static and confidence schedules, full and reduced draft vocabularies: with the
broadcast, both ranks verify and commit the same drafts, counts, bonus tokens and slot token ids;
planted without it (`rank_sync`), they do not. At one rank `share` is the identity (and the step stays sync-free:
test_worker_step_capture.py). Cost: one spawn of two processes per test, ~10 s on an idle 2-core box.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_sgl.faults import plant
from dspark_sgl.sglang.ranks import RankSync

CASES = ("greedy/static/full", "greedy/confidence/reduced", "sampled/static/reduced", "sampled/confidence/full")
FIELDS = ("tokens", "draft_logits", "lengths", "accepted", "bonus", "seq_lens", "context_k", "context_v", "slot_ids")


class GlooGroup:
    """The part of SGLang's GroupCoordinator that RankSync uses, over torch.distributed's default (gloo) group."""

    def __init__(self):
        self.world_size, self.rank_in_group, self.calls = dist.get_world_size(), dist.get_rank(), 0

    def broadcast(self, tensor, src: int = 0):
        self.calls += 1
        dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def _rank(rank: int, store: str, out: str, planted: str | None) -> None:
    from tests.test_worker_step_capture import decode_step, inputs, make_draft, make_rows, planner, run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = GlooGroup()
    ranks = RankSync(group)
    results = {}
    with plant(planted), torch.no_grad():
        # the helper alone: shapes and dtypes kept, every rank holds rank 0's values
        own = (torch.arange(6).view(3, 2) + 10 * rank, torch.tensor([1, 2, 3], dtype=torch.int32) * (rank + 1))
        results["helper"] = ranks.share(*own)
        # start-up: each rank found another SPS cache (another node); all take rank 0's table and buckets
        results["sps_state"] = ranks.share_object({"measured": {8: 10.0 + rank}, "buckets": [1 + rank]})
        for case in CASES:
            mode, schedule, vocab = case.split("/")
            draft = make_draft(vocab)
            if rank:  # another draft on rank 1: its proposals and confidences differ from rank 0's
                torch.manual_seed(rank)
                for p in draft.parameters():
                    p.add_(torch.randn_like(p) * 0.3)
            x, rows = inputs(draft, 4, seed=3), make_rows(mode, 4)  # same seed: the target's side is shared
            results[case] = dict(zip(FIELDS, run(decode_step, draft, planner(schedule), rows, x, ranks=ranks),
                                     strict=True))
    results["broadcasts"] = group.calls
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def two_ranks(tmp_path: Path, planted: str | None = None) -> tuple[dict, dict]:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), planted), nprocs=2, join=True)
    return torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")


RANK_OWN = {"draft_logits", "context_k", "context_v"}  # made by each rank's own draft weights: never shared


def disagreements(r0: dict, r1: dict) -> list[str]:
    """The committed fields that differ between the ranks. Which slots got context is committed (`slot_ids` are
    written under the same keep mask); the context K/V values are rank 1's own draft's projections."""
    return [f"{case}.{f}" for case in CASES for f in FIELDS
            if f not in RANK_OWN and not torch.equal(r0[case][f], r1[case][f])]


def test_one_rank_is_the_identity():
    a, b = torch.arange(4), torch.ones(4, 2, dtype=torch.int32)

    class One:
        world_size = 1

        def broadcast(self, *_):
            raise AssertionError("no collective at one rank")

    for ranks in (RankSync(), RankSync(One())):
        assert not ranks.active
        shared = ranks.share(a, b)
        assert shared[0] is a and shared[1] is b


def test_two_ranks_commit_rank_0s_decisions(tmp_path):
    r0, r1 = two_ranks(tmp_path)
    tokens, lengths = r1["helper"]
    assert torch.equal(tokens, torch.arange(6).view(3, 2)) and tokens.dtype == torch.int64
    assert torch.equal(lengths, torch.tensor([1, 2, 3], dtype=torch.int32)) and lengths.dtype == torch.int32
    assert r0["broadcasts"] == r1["broadcasts"] == 1 + 2 * len(CASES)  # one per share: two per decode step
    assert r0["sps_state"] == r1["sps_state"] == {"measured": {8: 10.0}, "buckets": [1]}
    for case in CASES:  # the drafts do differ
        assert not torch.equal(r0[case]["draft_logits"], r1[case]["draft_logits"])
    assert disagreements(r0, r1) == []


@pytest.mark.planted
def test_planted_unshared_ranks_diverge(tmp_path):
    """Without the broadcast the ranks verify and commit different tokens: the agreement check above fails."""
    r0, r1 = two_ranks(tmp_path, planted="rank_sync")
    assert r1["broadcasts"] == 0
    assert {f"{case}.tokens" for case in CASES} <= set(disagreements(r0, r1))


# ---- live draft updates: every rank installs the update, or none does ---------------------------------------------
UPDATE_CASES = ("same folder", "folder missing on rank 1", "NaN tensor on rank 1")


def _update_rank(rank: int, store: str, tmp: str, planted: str | None) -> None:
    """Each rank's DraftUpdater gets the same calls, as SGLang's scheduler hands them to every TP rank, but reads
    what its own node has: rank 1 may lack the folder or receive a corrupt tensor."""
    from dspark_sgl.model.checkpoint import save_draft
    from dspark_sgl.sglang.weights import named_tensors
    from tests.test_live_update import Host, make_draft

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tmp = Path(tmp)
    host = Host(make_draft(0))
    host.updater._ranks = RankSync(GlooGroup())
    new = make_draft(1)
    if rank == 0:
        save_draft(new, tmp / "new")
    dist.barrier()
    results = {}
    with plant(planted):
        for case in UPDATE_CASES:
            if case == "NaN tensor on rank 1":
                items = named_tensors(new)
                if rank:
                    items = [(k, v.clone().fill_(float("nan")) if k == "fc.weight" else v) for k, v in items]
                ok, msg = host.updater.update_weights_from_tensor(items)
            else:
                path = tmp / ("elsewhere" if rank and case == "folder missing on rank 1" else "new")
                ok, msg = host.updater.update_weights_from_disk(str(path), "auto")
            results[case] = {"ok": ok, "msg": msg, "fc": host.draft.fc.weight.detach().clone()}
            host.draft = make_draft(0)  # back to the old draft for the next case
    torch.save(results, tmp / f"update{rank}.pt")
    dist.destroy_process_group()


def two_rank_updates(tmp_path: Path, planted: str | None = None) -> tuple[dict, dict]:
    mp.spawn(_update_rank, args=(str(tmp_path / "store"), str(tmp_path), planted), nprocs=2, join=True)
    return torch.load(tmp_path / "update0.pt"), torch.load(tmp_path / "update1.pt")


def test_a_draft_update_lands_on_every_rank_or_on_none(tmp_path):
    r0, r1 = two_rank_updates(tmp_path)
    assert r0["same folder"]["ok"] and r1["same folder"]["ok"]
    for case in UPDATE_CASES:
        assert r0[case]["ok"] == r1[case]["ok"] and torch.equal(r0[case]["fc"], r1[case]["fc"]), case
    for case in UPDATE_CASES[1:]:  # refused on both ranks, and rank 0 (whose answer the client sees) names rank 1
        assert not r0[case]["ok"] and r0[case]["msg"] == r1[case]["msg"], case
        assert "rank 1: " in r0[case]["msg"] and "rank 0: " not in r0[case]["msg"], r0[case]["msg"]
    assert "is not a folder" in r0["folder missing on rank 1"]["msg"]
    assert "NaN" in r0["NaN tensor on rank 1"]["msg"]


@pytest.mark.planted
def test_planted_rank_local_updates_diverge(tmp_path):
    """Without the agreement rank 0 installs what rank 1 could not read: the ranks serve different drafts while the
    client is told the update succeeded."""
    r0, r1 = two_rank_updates(tmp_path, planted="rank_agree")
    for case in UPDATE_CASES[1:]:
        assert r0[case]["ok"] and not r1[case]["ok"], case
        assert not torch.equal(r0[case]["fc"], r1[case]["fc"]), case
