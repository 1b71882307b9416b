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
from dspark_sgl.speculative.sts import apply_sts, save_sts
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


def test_live_profile_fills_a_monotone_table_and_saves_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    path = tmp_path / "sps.json"
    planner = VerifyPlanner.from_server_args(spec_args(sps=str(path)), draft)
    assert planner.policy == "confidence" and planner.sps is None and planner.needs_profile(3)
    # before any table exists the planner verifies everything (never guesses a flat table)
    assert planner.verify_lengths(torch.zeros(2, 3), 2, "cpu").tolist() == [4, 4]

    planner.add_profile(3, {1: 100.0, 2: 60.0, 3: 70.0, 4: 40.0})  # a measured bump at width 3
    assert not planner.needs_profile(4) and planner.needs_profile(5)
    saved = SpsTable.load(path)
    assert saved.tokens == [3, 6, 9, 12] and saved.is_monotone()
    assert saved.meta["raw_steps_per_s"] == [100.0, 60.0, 70.0, 40.0]

    planner.add_profile(1, {1: 200.0, 2: 150.0, 3: 120.0, 4: 110.0})
    assert SpsTable.load(path).tokens == [1, 2, 3, 4, 6, 9, 12]


def test_a_given_table_is_loaded_and_never_reprofiled(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    path = tmp_path / "sps.json"
    SpsTable([1, 8, 64], [100.0, 90.0, 20.0]).save(path)
    planner = VerifyPlanner.from_server_args(spec_args(sps=str(path)), DSparkDraft(tiny_draft_config(block_size=3)))
    assert planner.sps.tokens == [1, 8, 64] and not any(planner.needs_profile(b) for b in (1, 7, 48, 1000))
    planner.add_profile(1, {1: 1.0})  # never called by the worker then; must not overwrite the operator's file
    assert json.loads(path.read_text())["steps_per_s"] == [100.0, 90.0, 20.0]


def test_lengths_are_the_shared_scheduler_with_sts(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    sts = tmp_path / "sts.json"
    save_sts(sts, torch.tensor([1.0, 2.0, 0.5]))
    planner = VerifyPlanner.from_server_args(spec_args(sts=str(sts)), DSparkDraft(tiny_draft_config(block_size=3)))
    planner.add_profile(4, {1: 100.0, 2: 50.0, 3: 34.0, 4: 25.0})  # cost linear in tokens
    z = torch.tensor([[4.0, 4.0, 4.0], [-4.0, 4.0, 4.0], [4.0, -4.0, 0.0], [0.0, 0.0, 0.0]])
    conf = apply_sts(z, torch.tensor([1.0, 2.0, 0.5]))
    got = planner.verify_lengths(z, 4, "cpu")
    # the worker's verify pads every row to the longest, so it schedules one width for the batch (padded rule)
    assert torch.equal(got, schedule(conf, planner.sps, "confidence", padded=True))
    assert got.tolist() == [1, 1, 1, 1]  # cost linear in tokens: 2.5 expected drafts in column 0 do not pay for 4
    assert schedule(conf, planner.sps, "confidence").tolist() == [3, 1, 2, 1]  # per request: padded to 3
    planner.add_profile(4, {1: 100.0, 2: 100.0, 3: 100.0, 4: 100.0})  # a verify as cheap at 16 tokens as at 4
    assert planner.verify_lengths(z, 4, "cpu").tolist() == [4, 4, 4, 4]


def test_static_policy_and_stats(monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "static")
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)))
    assert planner.policy == "static" and not planner.needs_profile(1)
    lengths = planner.verify_lengths(torch.full((2, 3), 5.0), 2, "cpu")
    assert lengths.tolist() == [4, 4]
    planner.record(lengths, 4, torch.tensor([3, 1]))
    info = planner.info()
    assert info["schedule"] == "static" and info["mean_target_tokens_per_request"] == 4
    assert info["mean_accepted_drafts"] == 2 and info["decode_steps"] == 1
    planner.clear()
    assert planner.info()["decode_steps"] == 0


def test_per_machine_cache_resumes_measured_buckets(tmp_path, monkeypatch):
    """Without a table path the measurements persist per engine: a restart profiles only buckets it never met, and
    new buckets merge with the old raw values (smoothed as if measured in one run)."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    cache = tmp_path / "sps" / "engine.json"  # its folder does not exist yet
    first = VerifyPlanner.from_server_args(spec_args(), draft, cache)
    assert first.needs_profile(1) and first.sps is None
    first.add_profile(1, {1: 200.0, 2: 150.0, 3: 160.0, 4: 110.0})
    assert SpsTable.load(cache).meta["buckets"] == [1]

    again = VerifyPlanner.from_server_args(spec_args(), draft, cache)
    assert not again.needs_profile(1) and again.needs_profile(2) and again.needs_profile(16)
    assert again.sps.to_dict() == first.sps.to_dict()
    assert torch.equal(again.verify_lengths(torch.zeros(1, 3), 1, "cpu"), first.verify_lengths(torch.zeros(1, 3), 1,
                                                                                                "cpu"))
    again.add_profile(2, {1: 180.0, 2: 120.0, 3: 90.0, 4: 70.0})
    saved = SpsTable.load(cache)
    assert saved.meta["buckets"] == [1, 2] and saved.tokens == [1, 2, 3, 4, 6, 8]
    assert saved.meta["raw_steps_per_s"] == [200.0, 180.0, 160.0, 120.0, 90.0, 70.0]  # 2 = 150 remeasured as 180
    assert saved.is_monotone()

    explicit = tmp_path / "given.json"  # an operator's table path wins: the cache is neither read nor written
    mine = VerifyPlanner.from_server_args(spec_args(sps=str(explicit)), draft, cache)
    assert mine.needs_profile(1) and mine.save_path == explicit


def test_unreadable_cache_is_measured_anew(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    cache = tmp_path / "engine.json"
    for junk in ('{"tokens": [1], "steps_per_s": [5.0]}', "{", '{"tokens": [2, 1], "steps_per_s": [1, 1]}'):
        cache.write_text(junk)  # no buckets / torn / invalid
        planner = VerifyPlanner.from_server_args(spec_args(), draft, cache)
        assert planner.needs_profile(1) and planner.sps is None
    planner.add_profile(1, {1: 10.0})
    assert SpsTable.load(cache).meta["buckets"] == [1]


def test_static_policy_ignores_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "static")
    planner = VerifyPlanner.from_server_args(spec_args(), DSparkDraft(tiny_draft_config(block_size=3)),
                                             tmp_path / "engine.json")
    assert planner.save_path is None and not planner.needs_profile(1)


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


def test_adopt_takes_another_planners_state(tmp_path, monkeypatch):
    """What a TP rank does with rank 0's state at start-up (RankSync.share_object): same table, same buckets."""
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)
    draft = DSparkDraft(tiny_draft_config(block_size=3))
    rank0, rank1 = (VerifyPlanner.from_server_args(spec_args(), draft) for _ in range(2))
    rank0.add_profile(4, {1: 100.0, 2: 50.0, 3: 34.0, 4: 25.0})
    rank1.add_profile(1, {1: 1.0})
    rank1.adopt(rank0.state())
    assert rank1.state() == rank0.state() and rank1.needs_profile(1) and not rank1.needs_profile(3)
