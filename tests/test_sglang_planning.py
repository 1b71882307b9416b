"""The SGLang worker's verify planning (policy choice, live SPS table, STS) without SGLang itself."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.sglang.planning import VerifyPlanner, choose_policy, size_bucket, sps_cache_file
from dspark_sgl.speculative.scheduler import schedule
from dspark_sgl.speculative.sps import SpsTable
from dspark_sgl.speculative.sts import apply_sts
from tests.conftest import tiny_draft_config


def spec_args(sps=None, sts=None):
    return SimpleNamespace(speculative_dspark_sps_table_path=sps, speculative_dspark_confidence_sts_path=sts)


@pytest.mark.parametrize(
    ("head", "mode", "policy"),
    [(True, None, "confidence"), (False, None, "static"), (True, "static", "static"),
     (True, "compact", "confidence"), (True, "cap-accept", "confidence"), (False, "static", "static")],
)
def test_policy_follows_sglang_switch_and_defaults_to_confidence(head, mode, policy):
    assert choose_policy(head, mode) == policy


def test_policy_errors():
    with pytest.raises(ValueError, match="expected one of"):
        choose_policy(True, "ragged")
    with pytest.raises(ValueError, match="needs a draft with a confidence head"):
        choose_policy(False, "compact")


def test_size_buckets():
    assert [size_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 48)] == [1, 2, 4, 4, 8, 8, 16, 64]


def feed(planner: VerifyPlanner, batch_size: int, off_ms: float, draft_ms: float, after_ms: dict[int, float],
         repeats: int = 3) -> None:
    """What StepTimes hands the planner after each step: phase seconds of off steps and speculative steps."""
    for _ in range(repeats):
        planner.observe_timing({"batch_size": batch_size, "speculate": False, "width": 1},
                               {"decide": 0.0, "verify": off_ms / 1e3})
        for w, ms in after_ms.items():
            planner.observe_timing({"batch_size": batch_size, "speculate": True, "width": w},
                                   {"draft": draft_ms / 1e3, "rollout": 0.0, "verify": ms / 1e3})


def test_costs_come_from_step_timings_and_price_the_width(monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)))
    assert planner.policy == "confidence" and planner.rule.config.mode == "auto"
    # before any cost exists: speculate (cold start) at the whole window, never a guessed table
    assert planner.decide(4).speculate and planner.decide(4).why == "cold"
    assert planner.verify_lengths(torch.zeros(4, 3), 4, "cpu").tolist() == [4, 4, 4, 4]
    feed(planner, 4, off_ms=10.0, draft_ms=2.0, after_ms={4: 70.0})  # width 4 costs 7x a plain step: 1 and 4 known
    costs = planner.rule.costs.spec_seconds(4)
    assert costs == pytest.approx([0.012, 0.032, 0.052, 0.072])
    z = torch.full((4, 3), 4.0)  # confident rows
    assert planner.verify_lengths(z, 4, "cpu").tolist() == [1, 1, 1, 1]  # (4 + 4 x 0.98) / 32 ms < 4 / 12 ms
    feed(planner, 4, off_ms=10.0, draft_ms=2.0, after_ms={4: 12.0}, repeats=9)  # a wide verify as cheap as a narrow
    assert planner.verify_lengths(z, 4, "cpu").tolist() == [4, 4, 4, 4]


def test_forced_steps_are_not_narrowed_by_the_step_bound(monkeypatch):
    """The run-time switch (and the start-up profile's drafted arm) forces widths up to its cap; the rule's step bound
    (1.7x the bucket's served median) is the rule's latency guard, not the operator's. A bucket that served off steps
    (median 10 ms) bounds the rule's own steps to width 1 (a width-2 step costs 22 ms), and a forced step still verifies
    its cap (the served hybrid test at stop 51: a shared server's bucket 24 had served off steps, the forced steps
    verified one column and the matches accepted nothing)."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)))
    feed(planner, 4, off_ms=10.0, draft_ms=2.0, after_ms={2: 20.0, 4: 24.0}, repeats=2)  # the first: warm-up
    for _ in range(10):  # served off steps make the bucket's median
        planner.observe_timing({"batch_size": 4, "speculate": False, "width": 1}, {"verify": 0.010})
    sure = torch.full((4, 3), 0.99)
    assert planner.lengths_from_conf(sure, 4, "cpu").tolist() == [1, 1, 1, 1]
    planner.set_forced_fraction(0.99)
    assert planner.lengths_from_conf(sure, 4, "cpu").tolist() == [4, 4, 4, 4]


def test_server_info_reports_each_buckets_step_time_spread(monkeypatch):
    """/server_info's step_time_ms per bucket: median, p99, max and the steps over twice the median, from the
    timings the worker hands the planner (every kind of step), never from another bucket's."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)))
    feed(planner, 4, off_ms=10.0, draft_ms=2.0, after_ms={4: 20.0}, repeats=5)  # 5 x 10 ms + 5 x 22 ms
    planner.observe_timing({"batch_size": 4, "speculate": False, "width": 1}, {"verify": 0.050})  # a stall
    planner.observe_timing({"batch_size": 1, "speculate": False, "width": 1}, {"verify": 0.005})
    spread = {b: r["step_time_ms"] for b, r in planner.info()["buckets"].items()}
    assert spread["4"] == {"timed": 11, "median": 22.0, "p99": 50.0, "max": 50.0, "over_2x_median": 1,
                           "over_2x_kinds": {"off": 1}}  # what the slow step was
    assert spread["1"] == {"timed": 1, "median": 5.0, "p99": 5.0, "max": 5.0, "over_2x_median": 0,
                           "over_2x_kinds": {}}
    planner.observe_timing({"batch_size": 4, "speculate": True, "width": 3, "match": True}, {"verify": 0.060})
    planner.observe_timing({"batch_size": 4, "speculate": True, "width": 4, "forced": True}, {"verify": 0.070})
    assert planner.info()["buckets"]["4"]["step_time_ms"]["over_2x_kinds"] == {"forced w4": 1, "match w3": 1,
                                                                             "off": 1}


def test_an_operator_sps_table_prices_the_width_only(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    path = tmp_path / "sps.json"
    SpsTable([1, 8, 64], [100.0, 90.0, 20.0]).save(path)
    planner = VerifyPlanner.from_server_args(spec_args(sps=str(path)), DSparkDraft(tiny_draft_config(block_size=3)))
    assert planner.sps.tokens == [1, 8, 64] and planner.save_path is None
    z = torch.tensor([[4.0, 4.0, 4.0], [-4.0, 4.0, 4.0], [4.0, -4.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(planner.verify_lengths(z, 4, "cpu"), schedule(apply_sts(z, None), planner.sps, padded=True))
    planner.save()  # never overwrites the operator's file
    assert json.loads(path.read_text())["steps_per_s"] == [100.0, 90.0, 20.0]
    bad = tmp_path / "bad.json"
    bad.write_text('{"nothing": 1}')
    with pytest.raises(ValueError, match="neither a cost table nor an SPS table"):
        VerifyPlanner.from_server_args(spec_args(sps=str(bad)), DSparkDraft(tiny_draft_config(block_size=3)))


def test_static_policy_always_speculates_and_stats(monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "static")
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)))
    assert planner.policy == "static" and planner.rule.config.mode == "on"
    feed(planner, 2, off_ms=1.0, draft_ms=50.0, after_ms={4: 10.0})  # speculation cannot pay: still on (fixed)
    decision = planner.decide(2)
    assert decision.speculate and decision.why == "forced"
    lengths = planner.verify_lengths(torch.full((2, 3), 5.0), 2, "cpu")
    assert lengths.tolist() == [4, 4] and planner.host_width(torch.zeros(2, 3)) == 4
    planner.record(lengths, 4, torch.tensor([3, 1]), decision)
    planner.record_step(2, decision, 4)
    info = planner.info()
    assert info["schedule"] == "static" and info["mean_target_tokens_per_request"] == 4
    assert info["mean_accepted_drafts"] == 2 and info["decode_steps"] == 1
    assert info["buckets"]["2"]["speculated_share"] == 1.0 and info["buckets"]["2"]["width_hist"] == {"4": 1}
    assert info["buckets"]["2"]["realized_accept_length"] == 3.0
    planner.clear()
    assert planner.info()["decode_steps"] == 0


def test_operator_switch_cap_and_run_time_fraction(monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    capped = VerifyPlanner.from_server_args(spec_args(), draft, mode="auto", max_batch=4)
    assert capped.decide(4).speculate and not capped.decide(5).speculate
    planner = VerifyPlanner.from_server_args(spec_args(), draft, mode="off")
    assert not planner.decide(1).speculate
    planner.set_forced_fraction(0.5)  # width ceil(0.5 x 4) = 2
    assert planner.decide(1).speculate and planner.verify_lengths(torch.zeros(3, 3), 3, "cpu").tolist() == [2, 2, 2]
    planner.set_forced_fraction(0.2)  # width 1: off
    assert not planner.decide(1).speculate
    planner.set_forced_fraction(1.0)  # back to the operator's mode
    assert not planner.decide(1).speculate and planner.info()["speculate"] == "off"


def test_per_machine_cache_keeps_the_learnt_costs(tmp_path, monkeypatch):
    """Without a table path the learnt costs persist per engine: a restart starts from them."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    cache = tmp_path / "sps" / "engine.json"  # its folder does not exist yet
    first = VerifyPlanner.from_server_args(spec_args(), draft, cache)
    feed(first, 4, off_ms=10.0, draft_ms=2.0, after_ms={4: 40.0}, repeats=4)  # both arms of bucket 4 timed (after
    # each one's warm-up step) 3 times: written, and past the cold start
    assert list(json.loads(cache.read_text())["buckets"]) == ["4"]
    first.info()  # reading /server_info writes the table
    again = VerifyPlanner.from_server_args(spec_args(), draft, cache)
    assert again.rule.costs.to_dict() == first.rule.costs.to_dict() and again.save_path == cache
    assert not again.decide(4).why == "cold"
    for junk in ('{"tokens": [1], "steps_per_s": [5.0]}', "{", '{"width": 9, "buckets": {}}'):
        cache.write_text(junk)  # an SPS table (not ours to trust here) / torn / another window
        planner = VerifyPlanner.from_server_args(spec_args(), draft, cache)
        assert not planner.rule.costs.buckets and planner.save_path == cache
    explicit = tmp_path / "given.json"  # an operator's path that does not exist yet receives the learnt table
    mine = VerifyPlanner.from_server_args(spec_args(sps=str(explicit)), draft, cache)
    feed(mine, 1, off_ms=5.0, draft_ms=1.0, after_ms={4: 9.0})
    mine.save()
    assert json.loads(explicit.read_text())["buckets"]["1"]["off"] == [0.005] * 2  # 3 steps, the first a warm-up
    loaded = VerifyPlanner.from_server_args(spec_args(sps=str(explicit)), draft)
    assert loaded.sps is None and loaded.rule.costs.off_seconds(1) == pytest.approx(0.005)


def test_cache_file_is_keyed_by_engine_and_can_be_turned_off(tmp_path, monkeypatch):
    facts = {"model_path": "/m", "tp_size": "1", "verify_width": 8, "hardware": "cpu x"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSPARK_SGL_SPS_CACHE", raising=False)
    home = sps_cache_file(facts)
    assert home.parent == tmp_path / "xdg" / "dspark-sgl" / "sps"
    assert sps_cache_file(dict(facts)) == home
    assert sps_cache_file({**facts, "tp_size": "2"}) != home and sps_cache_file({**facts, "verify_width": 4}) != home
    monkeypatch.setenv("DSPARK_SGL_SPS_CACHE", str(tmp_path / "elsewhere"))
    assert sps_cache_file(facts).parent == tmp_path / "elsewhere"
    monkeypatch.setenv("DSPARK_SGL_SPS_CACHE", "off")
    assert sps_cache_file(facts) is None


def test_adopt_takes_another_planners_state(monkeypatch):
    """What a TP rank does with rank 0's state at start-up (RankSync.share_object): the same costs."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    rank0, rank1 = (VerifyPlanner.from_server_args(spec_args(), draft) for _ in range(2))
    feed(rank0, 4, off_ms=10.0, draft_ms=2.0, after_ms={4: 40.0})
    feed(rank1, 1, off_ms=1.0, draft_ms=2.0, after_ms={4: 4.0})
    rank1.adopt(rank0.state())
    assert rank1.state() == rank0.state()
