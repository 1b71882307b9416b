"""Live draft updates without a server: validation, staging, the whole-module swap, stale context, traffic records,
and the trainer's publisher against a stand-in HTTP server. The real-SGLang run is tests/test_sglang_live_update.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_sgl.model.checkpoint import WEIGHTS_FILE, save_draft
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.sglang.context import DraftContextPool
from dspark_sgl.sglang.planning import VerifyPlanner
from dspark_sgl.sglang.traffic import TrafficConfig, TrafficRecorder, traffic_files
from dspark_sgl.sglang.weights import (
    DraftUpdater,
    UpdateRefused,
    inside_draft_root,
    is_draft_folder,
    named_tensors,
)
from dspark_sgl.speculative.sps import SpsTable
from tests.conftest import tiny_draft_config
from training.data import read_cache
from training.publish import PublishConfig, Publisher
from training.recipe import RecipeError, load_recipe


def make_draft(seed: int, **over) -> DSparkDraft:
    torch.manual_seed(seed)
    c = tiny_draft_config(**over)
    heads = (torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size))
    return DSparkDraft(c).eval().bind_target(*heads)


def snapshot(draft: DSparkDraft) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in draft.state_dict().items()}


class Host:
    """What the worker gives the updater: the serving draft, install and invalidate."""

    def __init__(self, draft: DSparkDraft):
        self.draft, self.installed, self.invalidated = draft, [], 0
        self.updater = DraftUpdater(lambda: self.draft, self.install, self.invalidate)

    def install(self, release) -> None:
        self.installed.append(release)
        self.draft = release.draft

    def invalidate(self) -> None:
        self.invalidated += 1


@pytest.fixture
def host() -> Host:
    return Host(make_draft(0))


def test_a_reduced_vocabulary_draft_updates_with_its_d2t(tmp_path):
    """The int64 d2t buffer of a reduced draft vocabulary is part of the update (not refused as a non-float weight,
    not cast to float)."""
    host = Host(make_draft(0, draft_vocab_size=10))
    host.draft.set_vocab(torch.arange(10))
    new = make_draft(1, draft_vocab_size=10)
    new.set_vocab(torch.arange(10) * 3)
    save_draft(new, tmp_path / "d")
    ok, msg = host.updater.update_weights_from_disk(str(tmp_path / "d"), "auto")
    assert ok, msg
    assert host.draft.d2t.dtype == torch.long and host.draft.vocab.tolist() == list(range(0, 30, 3))


def test_disk_update_installs_a_whole_new_draft_with_its_sts_sps_and_version(host, tmp_path):
    old, before = host.draft, snapshot(host.draft)
    new = make_draft(1)
    new.config.sts_temperatures = [1.5, 1.2, 1.1, 1.0]
    save_draft(new, tmp_path / "d")
    SpsTable([1, 2, 4], [50.0, 40.0, 20.0]).save(tmp_path / "d" / "sps.json")
    (tmp_path / "d" / "publish.json").write_text(json.dumps({"version": "step-7", "step": 7}))

    ok, msg = host.updater.update_weights_from_disk(str(tmp_path / "d"), "auto")
    assert ok, msg
    rel = host.installed[-1]
    assert host.draft is rel.draft and host.draft is not old
    for k, v in new.state_dict().items():
        assert torch.equal(host.draft.state_dict()[k], v), k
    for k, v in before.items():  # the old module is untouched: a step still holding it ran on old weights only
        assert torch.equal(old.state_dict()[k], v), k
    assert rel.sts == [1.5, 1.2, 1.1, 1.0] and rel.sps.tokens == [1, 2, 4]
    assert host.draft.target.lm_head is old.target.lm_head  # the target's heads stay shared
    r = host.updater.record
    assert (r.version, r.step, r.swaps, r.refused) == ("step-7", 7, 1, 0)
    assert r.source.startswith("disk:") and r.last_swap_ms > 0


def _corrupt(kind: str, folder):
    if kind == "config":  # a different draft shape altogether
        save_draft(make_draft(1, intermediate_size=96), folder)
        return "intermediate_size"
    save_draft(make_draft(1), folder)
    state = load_file(str(folder / WEIGHTS_FILE))
    if kind == "nan":
        state["fc.weight"][0, 0] = float("nan")
        expect = "NaN/inf in: ['fc.weight']"
    elif kind == "shape":
        state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
        expect = "mis-shaped tensors"
    elif kind == "missing":
        del state["norm.weight"]
        expect = "missing tensors: ['norm.weight']"
    else:  # dtype
        state["norm.weight"] = state["norm.weight"].to(torch.int32)
        expect = "non-floating tensors ['norm.weight (torch.int32)']"
    save_file(state, str(folder / WEIGHTS_FILE))
    return expect


@pytest.mark.parametrize("kind", ["nan", "shape", "missing", "dtype", "config"])
def test_bad_disk_update_is_refused_and_the_old_draft_keeps_serving(host, tmp_path, kind):
    old, before = host.draft, snapshot(host.draft)
    expect = _corrupt(kind, tmp_path / "bad")
    ok, msg = host.updater.update_weights_from_disk(str(tmp_path / "bad"), "auto")
    assert not ok and "refused" in msg and expect in msg, msg
    assert host.draft is old and not host.installed
    for k, v in before.items():
        assert torch.equal(old.state_dict()[k], v)
    assert host.updater.record.refused == 1 and host.updater.record.swaps == 0


def test_target_folder_leaves_the_draft_but_marks_its_context_stale(host, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_draft_folder(tmp_path / "t")
    ok, _ = host.updater.update_weights_from_disk(str(tmp_path / "t"), "auto")
    assert ok and not host.installed and host.invalidated == 1


def test_tensor_session_installs_only_when_complete(host):
    new = make_draft(2)
    items = named_tensors(new, version="v2", step=2)
    assert items[0][0] == "dspark_meta.config"
    half = len(items) // 2
    host.updater.begin_weight_update()
    ok, msg = host.updater.update_weights_from_tensor(items[:half])
    assert ok and "staged" in msg and not host.installed
    ok, msg = host.updater.update_weights_from_tensor(items[half:])
    host.updater.end_weight_update(run_post_load=False)
    assert ok and len(host.installed) == 1, msg
    assert torch.equal(host.draft.fc.weight, new.fc.weight)
    assert (host.updater.record.version, host.updater.record.source) == ("v2", "tensor")


def test_tensor_updates_refused_by_name_nan_and_incomplete_session(host):
    old = host.draft
    items = named_tensors(make_draft(3))
    bad = [(n, torch.full_like(t, float("nan")) if n == "norm.weight" else t) for n, t in items]
    host.updater.begin_weight_update()
    ok, msg = host.updater.load_weights_from_distributed(bad)
    host.updater.end_weight_update(run_post_load=False)
    assert not ok and "NaN/inf in: ['norm.weight']" in msg
    host.updater.begin_weight_update()
    ok, msg = host.updater.update_weights_from_tensor([("layers.9.mlp.up_proj.weight", torch.zeros(2))])
    assert not ok and "unexpected tensor 'layers.9.mlp.up_proj.weight'" in msg
    host.updater.begin_weight_update()
    ok, _ = host.updater.update_weights_from_tensor(items[:3])
    host.updater.end_weight_update(run_post_load=False)  # incomplete: dropped, nothing installed
    assert ok and host.draft is old and not host.installed
    assert host.updater.record.refused == 3 and "session ended without" in host.updater.record.last_error


def test_context_written_before_a_swap_is_reported_stale():
    draft = make_draft(0)
    pool = DraftContextPool(draft, num_slots=16, device="cpu", dtype=torch.float32)
    aux = torch.randn(6, draft.config.num_aux * draft.config.hidden_size)
    req_to_token = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 6]])
    pool.write(torch.tensor([0, 1, 3, 4, 5]), aux[:5], torch.tensor([0, 1, 0, 1, 2]))
    lengths = torch.tensor([2, 3])
    assert pool.gather(req_to_token, torch.tensor([0, 1]), lengths).stale is None  # no swap yet: nothing to check
    new = make_draft(1)
    pool.new_epoch(new)
    assert pool.draft is new
    stale = pool.gather(req_to_token, torch.tensor([0, 1]), lengths).stale
    assert stale.tolist() == [True, True]
    pool.write(torch.tensor([0, 1, 2]), aux[:3], torch.tensor([0, 1, 2]))  # request 0 rebuilt by the new draft
    stale = pool.gather(req_to_token, torch.tensor([0, 1]), torch.tensor([3, 3])).stale
    assert stale.tolist() == [False, True]
    # only the first `lengths` slots count: an old slot beyond them is not read
    assert pool.gather(req_to_token[:1], torch.tensor([0]), torch.tensor([3])).stale.tolist() == [False]


def test_planner_takes_the_release_sts_and_keeps_the_measured_costs():
    from dspark_sgl.speculative.scheduler import FullCostRule

    p = VerifyPlanner("confidence", 4, FullCostRule(4), torch.tensor([2.0] * 4, dtype=torch.float64))
    p.rule.costs.observe_off(1, 0.01)
    p.rule.observe_accept(1, 5, torch.tensor([4]))
    costs = p.rule.costs.to_dict()
    p.use_release(None, None)
    assert p.temperatures is None and p.sps is None and p.rule.costs.to_dict() == costs  # the costs are the engine's
    assert p.rule.overall.samples == 0  # the acceptance was the old draft's
    p.use_release([1.0, 1.1, 1.2, 1.3], SpsTable([1, 2], [9.0, 8.0]))
    assert p.temperatures.tolist() == [1.0, 1.1, 1.2, 1.3] and p.sps.tokens == [1, 2]


@pytest.fixture
def root_and_outside(tmp_path):
    root, outside = tmp_path / "drafts", tmp_path / "elsewhere"
    for d in (root / "v2", outside / "evil"):
        d.mkdir(parents=True)
    return root, outside


def test_a_draft_inside_the_root_is_returned_resolved(root_and_outside):
    root, _ = root_and_outside
    (root / "latest").symlink_to(root / "v2")  # a link that stays inside is fine
    assert inside_draft_root(root / "v2", root) == (root / "v2").resolve()
    assert inside_draft_root(root / "latest", root) == (root / "v2").resolve()
    assert inside_draft_root(root / "v2" / ".." / "v2", root) == (root / "v2").resolve()


@pytest.mark.parametrize("make_path, message", [
    (lambda root, out: out / "evil", "outside the draft root"),
    (lambda root, out: root / ".." / "elsewhere" / "evil", "outside the draft root"),
    (lambda root, out: root / "missing", "does not exist"),
])
def test_a_draft_outside_the_root_or_missing_is_refused(root_and_outside, make_path, message):
    root, outside = root_and_outside
    with pytest.raises(UpdateRefused, match=message):
        inside_draft_root(make_path(root, outside), root)


def test_a_symlink_inside_the_root_pointing_out_is_refused(root_and_outside):
    """The path is judged by where it leads: a link planted in the root cannot smuggle another folder in."""
    root, outside = root_and_outside
    (root / "link").symlink_to(outside / "evil")
    (root / "v2" / "up").symlink_to(root.parent)
    for path in (root / "link", root / "v2" / "up" / "elsewhere" / "evil"):
        with pytest.raises(UpdateRefused, match=f"resolves to {outside / 'evil'}, outside the draft root"):
            inside_draft_root(path, root)


def test_a_sibling_sharing_the_roots_name_prefix_is_outside(root_and_outside):
    root, _ = root_and_outside
    (root.parent / "drafts-old").mkdir()
    with pytest.raises(UpdateRefused, match="outside the draft root"):
        inside_draft_root(root.parent / "drafts-old", root)


def test_a_missing_root_is_named(tmp_path):
    with pytest.raises(UpdateRefused, match=r"the draft root .*nowhere \(dspark_draft_root\) does not exist"):
        inside_draft_root(tmp_path, tmp_path / "nowhere")


def test_the_disk_update_hook_refuses_outside_the_root_and_loads_the_resolved_path(root_and_outside, monkeypatch):
    """weights.route_disk_update (SGLang's disk-update handler, wrapped): a refusal is SGLang's success=False (its
    HTTP 400) and nothing is loaded; a path inside goes on resolved. SGLang's reply type is stubbed here."""
    import sys
    import types

    from dspark_sgl.sglang import weights

    root, outside = root_and_outside
    stub = types.ModuleType("sglang.srt.managers.io_struct")
    stub.UpdateWeightFromDiskReqOutput = lambda **kw: kw
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    tp = types.ModuleType("sglang.srt.distributed")  # one rank: the shared decision is this process's own
    tp.get_tp_group = lambda: SimpleNamespace(world_size=1)
    monkeypatch.setitem(sys.modules, tp.__name__, tp)
    monkeypatch.setattr(weights, "draft_root", lambda: str(root))
    loaded = []

    def original(manager, req):
        loaded.append(req.model_path)
        return {"success": True}

    (root / "escape").symlink_to(outside / "evil")
    out = weights.route_disk_update(original, None, SimpleNamespace(model_path=str(root / "escape")))
    assert not out["success"] and "outside the draft root" in out["message"] and loaded == []
    (root / "latest").symlink_to(root / "v2")  # not a draft folder: SGLang's own handler gets the resolved path
    assert weights.route_disk_update(original, None, SimpleNamespace(model_path=str(root / "latest")))["success"]
    assert loaded == [str((root / "v2").resolve())]
    monkeypatch.setattr(weights, "draft_root", lambda: None)  # unset: any folder, as before
    weights.route_disk_update(original, None, SimpleNamespace(model_path=str(outside / "evil")))
    assert loaded[-1] == str(outside / "evil")


def _req(prompt, out, finished=True, rid="r", reason=None):
    return SimpleNamespace(origin_input_ids=prompt, output_ids=out, rid=rid, finished=lambda: finished,
                           finished_reason=reason)


def test_traffic_records_trainer_samples_with_rate_budget_and_no_pii_by_default(tmp_path):
    rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path), sample_rate=1.0))
    running = _req([1, 2, 3], [4], finished=False)
    aborted = _req([7], [8, 9], reason=type("FINISH_ABORT", (), {})())
    rec.observe([_req([1, 2, 3], [4, 5, 6], rid="secret"), running, aborted])
    rec.sweep()
    samples = read_cache(tmp_path / "samples.jsonl")
    assert list(samples) == [0] and samples[0].input_ids == [1, 2, 3, 4, 5, 6]
    assert samples[0].loss_mask == [False, False, False, True, True, True]
    assert "secret" not in (tmp_path / "samples.jsonl").read_text()
    assert rec.info()["recorded"] == 1 and rec.info()["skipped"] == 1 and len(rec.live) == 1

    half = TrafficRecorder(TrafficConfig(dir=str(tmp_path / "h"), sample_rate=0.5, seed=3))
    half.observe([_req([1], [2, 3], rid=str(i)) for i in range(200)])
    half.sweep()
    draws = random.Random(3)  # the recorder's seeded stream: one draw per finished request that qualifies
    assert half.recorded == sum(draws.random() < 0.5 for _ in range(200)) and half.recorded + half.skipped == 200

    small = TrafficRecorder(TrafficConfig(dir=str(tmp_path / "s"), max_bytes=400, keep=0, include_pii=True))
    small.observe([_req([1] * 10, [2] * 10, rid=f"id{i}") for i in range(5)])
    small.sweep()
    assert small.full and small.recorded >= 1 and small.recorded < 5 and small.bytes <= 400
    assert "id0" in (tmp_path / "s" / "samples.jsonl").read_text()
    again = TrafficRecorder(TrafficConfig(dir=str(tmp_path)))  # a restart continues the ids
    assert again.next_id == 1


def _record_sized(rec: TrafficRecorder, n: int) -> list[list[int]]:
    """n finished requests (a line is _line_bytes() long, 1 less for ids 0-9); their token lists in order."""
    reqs = [_req([100 + i] * 8, [200 + i] * 4) for i in range(n)]
    for r in reqs:
        rec.observe([r])
        rec.sweep()
    return [list(r.origin_input_ids) + list(r.output_ids) for r in reqs]


def _line_bytes() -> int:
    return len(json.dumps({"id": 10, "input_ids": [100] * 12, "loss_mask": [0] * 8 + [1] * 4})) + 1


def test_traffic_rotates_at_the_cap_keeping_whole_records_in_owner_only_files(tmp_path):
    """3 records fit a file: 10 records with keep=2 leave .2 (ids 3-5), .1 (6-8) and the live file (9); ids 0-2 were
    rotated out. Every file is under the cap, ends on a record boundary and is 0600 whatever the umask."""
    old = os.umask(0o022)
    try:
        rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path), max_bytes=3 * _line_bytes() + 5, keep=2))
        _record_sized(rec, 10)
    finally:
        os.umask(old)
    files = traffic_files(rec.path)
    assert [f.name for f in files] == ["samples.jsonl.2", "samples.jsonl.1", "samples.jsonl"]
    ids = []
    for f in files:
        text = f.read_text()
        assert text.endswith("\n") and f.stat().st_size <= rec.cfg.max_bytes
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        ids.append([json.loads(line)["id"] for line in text.splitlines()])
    assert ids == [[3, 4, 5], [6, 7, 8], [9]]
    assert rec.recorded == 10 and not rec.full
    assert TrafficRecorder(TrafficConfig(dir=str(tmp_path), keep=2)).next_id == 10  # a restart continues the ids


def test_a_record_no_file_could_hold_is_skipped_not_rotated_forever(tmp_path):
    rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path), max_bytes=_line_bytes() - 2, keep=2))
    _record_sized(rec, 2)
    assert rec.recorded == 0 and rec.skipped == 2 and traffic_files(rec.path) == []


def test_a_torn_last_line_is_dropped_before_appending(tmp_path):
    """A server killed mid-write: the next record starts on a line of its own, not glued to the partial one."""
    rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path)))
    _record_sized(rec, 2)
    with open(rec.path, "a") as f:
        f.write('{"id": 2, "input_ids": [1, 2')
    again = TrafficRecorder(TrafficConfig(dir=str(tmp_path)))
    _record_sized(again, 1)
    assert [json.loads(line)["id"] for line in rec.path.read_text().splitlines()] == [0, 1, 2]


def test_the_trainer_reads_a_rotated_recording_once_in_order(tmp_path, monkeypatch):
    """training.data.prepare_samples on a traffic folder: every record of every kept file, once, oldest first."""
    import transformers

    from training.data import DataConfig, prepare_samples

    rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path), max_bytes=2 * _line_bytes() + 5, keep=10))
    tokens = _record_sized(rec, 7)
    assert len(traffic_files(rec.path)) == 4  # 2 + 2 + 2 + 1
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace(pad_token_id=0))
    samples, _ = prepare_samples(DataConfig(), tmp_path, tmp_path, 0, 1, barrier=lambda: None)
    assert [s.id for s in samples] == list(range(7)) and [s.input_ids for s in samples] == tokens


RECORD_THEN_CRASH = """
import sys
from types import SimpleNamespace
from dspark_sgl.sglang.traffic import TrafficConfig, TrafficRecorder
rec = TrafficRecorder(TrafficConfig(dir=sys.argv[1]))
for rid in ("kept", "torn", "never"):
    rec._record(SimpleNamespace(origin_input_ids=[1, 2, 3], output_ids=[4, 5, 6], rid=rid, finished_reason=None))
"""


def test_a_recorder_killed_mid_write_leaves_whole_records_and_one_torn_line(tmp_path):
    """DSPARK_SGL_CRASH=traffic_write:torn (dspark_sgl/faults.py) kills the process with half of that record written:
    the trainer's reader drops the torn line, a restarted recorder cuts it. The served run: test_sglang_faults.py."""
    env = os.environ | {"DSPARK_SGL_CRASH": "traffic_write:torn"}
    res = subprocess.run([sys.executable, "-c", RECORD_THEN_CRASH, str(tmp_path)], env=env, capture_output=True)
    assert res.returncode == -signal.SIGKILL, res.stderr
    path = tmp_path / "samples.jsonl"
    whole, _, torn = path.read_text().rpartition("\n")
    assert json.loads(whole)["id"] == 0 and torn.startswith('{"id": 1, "input_ids": [1, 2, 3, 4')
    assert sorted(read_cache(path)) == [0]
    again = TrafficRecorder(TrafficConfig(dir=str(tmp_path)))
    assert path.read_text() == whole + "\n" and again.next_id == 1


def test_a_crash_site_must_be_known():
    res = subprocess.run([sys.executable, "-c", "import dspark_sgl.faults"], capture_output=True, text=True,
                         env=os.environ | {"DSPARK_SGL_CRASH": "publish_pasued"})
    assert res.returncode == 1 and "names no crash site" in res.stderr and "publish_paused" in res.stderr


def test_traffic_file_is_readable_by_its_owner_only(tmp_path):
    """Recorded traffic holds users' prompts: 0600 whatever the umask, and a wider file from before is narrowed."""
    old = os.umask(0o022)
    try:
        rec = TrafficRecorder(TrafficConfig(dir=str(tmp_path / "new")))
        rec.observe([_req([1, 2], [3, 4])])
        rec.sweep()
        assert rec.recorded == 1 and stat.S_IMODE(rec.path.stat().st_mode) == 0o600
        wide = tmp_path / "old" / "samples.jsonl"
        wide.parent.mkdir()
        wide.write_text(rec.path.read_text())
        wide.chmod(0o644)
        TrafficRecorder(TrafficConfig(dir=str(wide.parent)))
        assert stat.S_IMODE(wide.stat().st_mode) == 0o600
    finally:
        os.umask(old)


@pytest.mark.parametrize("bad, msg", [({"dir": "x", "sample_rate": 2}, "sample_rate=2 must be in [0, 1]"),
                                      ({"dir": "x", "max_bytes": 0}, "max_bytes=0 must be > 0"),
                                      ({"dir": "x", "keep": -1}, "keep=-1 must be >= 0"),
                                      ({"sample_rate": 1}, "at least 'dir'"),
                                      ({"dir": "x", "rate": 1}, "unknown dspark_traffic key(s) ['rate']")])
def test_traffic_config_errors_name_the_value(bad, msg):
    with pytest.raises(ValueError) as e:
        TrafficConfig.from_dict(bad)
    assert msg in str(e.value)


def test_publish_recipe_keys():
    r = load_recipe(None, ["publish.every_steps=5", "publish.url=http://127.0.0.1:30000"])
    assert r.publish.url == ["http://127.0.0.1:30000"] and r.publish.due(10) and not r.publish.due(7)
    with pytest.raises(RecipeError, match="publish.url lists no server"):
        load_recipe(None, ["publish.every_steps=5"])
    with pytest.raises(RecipeError, match="must be http://host:port"):
        load_recipe(None, ["publish.every_steps=5", "publish.url=[localhost:1]"])
    assert not load_recipe(None, []).publish.due(5)


class _Fake(BaseHTTPRequestHandler):
    calls: list = []
    refuse = False
    admin_key = None  # like SGLang's --admin-api-key: these endpoints answer 401 without it

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.calls.append((self.path, body))
        if self.admin_key and self.headers.get("Authorization") != f"Bearer {self.admin_key}":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(json.dumps({"error": "Unauthorized"}).encode())
            return
        ok = not (self.refuse and self.path == "/update_weights_from_disk")
        self.send_response(200 if ok else 400)
        self.end_headers()
        self.wfile.write(json.dumps({"success": ok, "message": "fine" if ok else "refused: NaN"}).encode())

    def log_message(self, *a):
        pass


def test_publisher_pauses_updates_continues_and_journals(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        pub = Publisher(PublishConfig(every_steps=1, url=[url], keep=1), tmp_path, log=lambda m: None)
        for step in (1, 2):
            folder = pub.folder(step)
            save_draft(make_draft(step), folder)
            res = pub.publish(folder, step)
            assert res[0]["success"] and res[0]["version"] == f"step-{step}"
        assert [p for p, _ in _Fake.calls[:3]] == ["/pause_generation", "/update_weights_from_disk",
                                                   "/continue_generation"]
        assert _Fake.calls[0][1] == {"mode": "in_place"}
        assert _Fake.calls[1][1]["model_path"] == str(pub.folder(1).resolve())
        assert json.loads((pub.folder(2) / "publish.json").read_text()) == {"version": "step-2", "step": 2}
        assert not pub.folder(1).exists()  # keep=1
        _Fake.refuse = True
        save_draft(make_draft(3), pub.folder(3))
        res = pub.publish(pub.folder(3), 3)
        assert not res[0]["success"] and _Fake.calls[-1][0] == "/continue_generation"  # resumed after a refusal
        lines = [json.loads(x) for x in (tmp_path / "publish.jsonl").read_text().splitlines()]
        assert [x["success"] for x in lines] == [True, True, False]
    finally:
        server.shutdown()


PUSH_THEN_CRASH = "import sys; from training.publish import push; push(sys.argv[1], sys.argv[2])"


def test_a_trainer_killed_mid_publish_leaves_the_server_paused_until_its_lease(tmp_path):
    """DSPARK_SGL_CRASH=publish_paused: the trainer dies after /pause_generation, before the update and the
    continue. Nothing it could do would end that pause (hence the server's lease, next test); the served run:
    tests/test_sglang_faults.py."""
    server = HTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Fake.calls = []
    try:
        res = subprocess.run([sys.executable, "-c", PUSH_THEN_CRASH, f"http://127.0.0.1:{server.server_port}",
                              str(tmp_path)], env=os.environ | {"DSPARK_SGL_CRASH": "publish_paused"},
                             capture_output=True, timeout=120)
    finally:
        server.shutdown()
    assert res.returncode == -signal.SIGKILL, res.stderr
    assert [p for p, _ in _Fake.calls] == ["/pause_generation"]


class _PausingManager:
    """What lease_pause wraps: SGLang's TokenizerManager's pause state and its two calls."""

    def __init__(self, lease: float):
        self.server_args = SimpleNamespace(json_model_override_args=json.dumps({"dspark_pause_lease_s": lease}))
        self.is_pause, self.continued = False, 0

    async def pause_generation(self, obj):
        self.is_pause = True

    async def continue_generation(self, obj):
        self.is_pause, self.continued = False, self.continued + 1


def test_a_pause_ends_by_itself_after_its_lease_and_only_its_own(monkeypatch):
    from dspark_sgl.sglang import weights

    monkeypatch.setattr(weights, "_continue_request", lambda: "continue")
    pause = _PausingManager.pause_generation

    async def scenario() -> list:
        seen = []
        tm = _PausingManager(lease=0.5)
        await weights.lease_pause(pause, tm, "in_place")  # the pauser dies: nobody continues
        await asyncio.sleep(0.7)
        seen.append((tm.is_pause, tm.continued))  # the lease ended it
        await weights.lease_pause(pause, tm, "in_place")
        await tm.continue_generation("continue")  # a pauser that lives
        await asyncio.sleep(0.25)
        await weights.lease_pause(pause, tm, "in_place")  # a newer pause: the older lease (due at 0.5) leaves it
        await asyncio.sleep(0.4)
        seen.append((tm.is_pause, tm.continued))
        await asyncio.sleep(0.4)
        seen.append((tm.is_pause, tm.continued))  # its own lease ended it
        off = _PausingManager(lease=0)
        await weights.lease_pause(pause, off, "in_place")
        await asyncio.sleep(0.1)
        seen.append((off.is_pause, off.continued))  # lease 0: paused until told
        return seen

    assert asyncio.run(scenario()) == [(False, 1), (True, 2), (False, 3), (True, 0)]


def test_publisher_sends_the_admin_key_from_the_environment_and_never_writes_it(tmp_path, monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, secret = f"http://127.0.0.1:{server.server_port}", "s3cret-admin-key"
    monkeypatch.setattr(_Fake, "admin_key", secret)
    monkeypatch.setattr(_Fake, "calls", [])
    monkeypatch.setattr(_Fake, "refuse", False)  # the test above leaves it set
    logged = []
    try:
        plain = Publisher(PublishConfig(every_steps=1, url=[url]), tmp_path / "nokey", log=logged.append)
        save_draft(make_draft(1), plain.folder(1))
        res = plain.publish(plain.folder(1), 1)
        assert not res[0]["success"] and res[0]["status"] == 401 and res[0]["message"] == "Unauthorized"

        cfg = PublishConfig(every_steps=1, url=[url], admin_key_env="DSPARK_TEST_ADMIN_KEY")
        monkeypatch.delenv("DSPARK_TEST_ADMIN_KEY", raising=False)
        with pytest.raises(ValueError, match=r"\$DSPARK_TEST_ADMIN_KEY is not set"):
            Publisher(cfg, tmp_path / "keyed")
        monkeypatch.setenv("DSPARK_TEST_ADMIN_KEY", secret)
        keyed = Publisher(cfg, tmp_path / "keyed", log=logged.append)
        save_draft(make_draft(2), keyed.folder(2))
        assert keyed.publish(keyed.folder(2), 2)[0]["success"]
        assert [p for p, _ in _Fake.calls[-3:]] == ["/pause_generation", "/update_weights_from_disk",
                                                    "/continue_generation"]
    finally:
        server.shutdown()
    written = [p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert written and not any(secret in text for text in written + logged)


def test_the_admin_key_is_named_not_written_in_the_recipe():
    r = load_recipe(None, ["publish.every_steps=5", "publish.url=http://127.0.0.1:30000",
                           "publish.admin_key_env=SGLANG_ADMIN_KEY"])
    assert r.publish.admin_key_env == "SGLANG_ADMIN_KEY"
    with pytest.raises(RecipeError, match="must name an environment variable"):
        load_recipe(None, ["publish.admin_key_env=sk-live-1234"])
