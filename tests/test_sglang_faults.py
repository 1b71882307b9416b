"""Faults (#24 item 5) on one DSPARK server started by `dspark serve` (real SGLang 0.5.23, CPU, fp32, SmolLM2 target,
a random block-3 draft), recording its traffic, in this order:

1. kill -9 the trainer in the middle of a publish: its publish step (tests/sglang_cpu/publish_step.py: export, then
   training.publish's pause -> update -> continue) dies by DSPARK_SGL_CRASH=publish_paused right after pausing the
   server, the worst point: nothing else would ever continue it. The server must serve on (its pause lease,
   `dspark_pause_lease_s`, 5 s here) with the old draft, greedy answers unchanged, and the resumed trainer's next
   publish must succeed.
2. abort every in-flight request at once during a live swap: with long requests running (half streamed), the swap is
   the trainer's sequence split open: pause, `/abort_request` abort_all plus every streaming client disconnecting,
   the disk update (another abort_all while it runs), continue. Every request is answered (no 5xx, no hang), the new
   draft serves, greedy answers equal plain decoding's, and the free KV tokens and request slots are back at idle.
3. kill -9 the server while it records traffic: the scheduler dies by DSPARK_SGL_CRASH=traffic_write:<rid> with half
   of that request's record written, other requests in flight; then the whole process group gets SIGKILL. The file
   holds whole records and one torn last line; the trainer's data preparation reads every whole record and drops the
   torn one; a recorder restarted on the folder (what the next server does) cuts the torn tail and goes on numbering.

Plain decoding's answers come from the reference engine's target in this process (HF, fp32), as the served worker
must reproduce them. Cost: one server start plus ~40 short requests and two trainer-step processes: 146 s on a
2-core EPYC with the default suite running beside it (docs/serving.md, "Faults").
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sglang_cpu"))
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import soak  # noqa: E402
from dspark_testkit import ServeCommand, build_random_draft  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # one server start (<= 600 s) and the three faults
]

MAX_NEW = 16
LONG_NEW = 96  # the in-flight requests that get aborted
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
LEASE_S = 5  # the server's pause lease (the product default is 60 s)
CRASH_RID = "fault-torn-record"  # the request whose traffic record tears
IN_FLIGHT = 8  # requests running when every one is aborted (half streamed)
JSON = {"Content-Type": "application/json"}


def port_in(lo: int = 31000, hi: int = 31999) -> int:
    """A free port in the range this project's helpers use."""
    for port in range(lo + os.getpid() % 500, hi):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> tuple[int | None, dict | str]:
    """(status, JSON body or text); (None, the exception) when no answer came."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=JSON)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except Exception as e:
        return None, repr(e)
    try:
        return status, json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def greedy(server: ServeCommand, prompt_ids: list[list[int]], timeout: float = 180) -> list[list[int]] | str:
    status, out = post(server.url, "/generate", {"input_ids": prompt_ids, "sampling_params": GREEDY}, timeout=timeout)
    return [o["output_ids"] for o in out] if status == 200 else f"{status}: {out}"


def plain_reference(target: Path, draft: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Plain greedy decoding by the reference engine's target (what a lossless worker must answer)."""
    from dspark_sgl.model.checkpoint import load_draft
    from dspark_sgl.speculative.engine import SpecEngine
    from dspark_sgl.targets.hf import HFTarget

    hf = HFTarget.from_pretrained(target, load_draft(draft).config.target_layer_ids)
    return [o.token_ids for o in SpecEngine(hf).generate(prompt_ids, MAX_NEW)]


def trainer_step(target: Path, out: Path, url: str, step: int, crash: str | None = None) -> dict:
    """One publish step in its own process (tests/sglang_cpu/publish_step.py); its exit code and results."""
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_SGL_CRASH"} | ({"DSPARK_SGL_CRASH": crash} if crash
                                                                              else {})
    res = subprocess.run([sys.executable, str(HERE / "sglang_cpu" / "publish_step.py"), str(target), str(out), url,
                          str(step)], capture_output=True, text=True, env=env, timeout=300)
    lines = res.stdout.strip().splitlines()
    results = json.loads(lines[-1]) if res.returncode == 0 and lines else None
    return {"rc": res.returncode, "results": results, "stderr": res.stderr[-2000:]}


def survive(fn, *args):
    """fn's answer, or the exception's repr (a server that stopped answering fails the asserts, not the fixture)."""
    try:
        return fn(*args)
    except Exception as e:
        return repr(e)


# ---- 1. the trainer killed mid-publish -------------------------------------------------------------------------
def kill_trainer_mid_publish(server: ServeCommand, target: Path, out: Path, prompt_ids) -> dict:
    before = soak.draft_record(server)
    killed = trainer_step(target, out, server.url, 1, crash="publish_paused")
    t0 = time.perf_counter()
    after_kill = greedy(server, prompt_ids, timeout=LEASE_S + 90)  # waits while paused: the lease must end it
    waited = time.perf_counter() - t0
    record_after_kill = survive(soak.draft_record, server)
    resumed = trainer_step(target, out, server.url, 2)
    return {"before": before, "killed": killed, "after_kill": after_kill, "waited_s": waited,
            "record_after_kill": record_after_kill, "resumed": resumed,
            "record_after_resume": soak.draft_record(server), "after_resume": greedy(server, prompt_ids)}


# ---- 2. every in-flight request aborted during a swap ---------------------------------------------------------
class Streamed:
    """A streamed request held open after its first event (so it is running), until `drop()` disconnects."""

    def __init__(self, url: str, body: dict):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.conn.request("POST", "/generate", json.dumps({**body, "stream": True}), JSON)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.first = next((line for line in self.resp if line.startswith(b"data:")), None)

    def drop(self) -> None:
        self.conn.close()


def abort_all_during_swap(server: ServeCommand, prompt_ids, swap: Path) -> dict:
    url = server.url
    body = {"sampling_params": {**GREEDY, "max_new_tokens": LONG_NEW}}
    answers: dict[int, tuple] = {}

    def plain_request(i: int) -> None:
        answers[i] = post(url, "/generate", {**body, "input_ids": prompt_ids[i % len(prompt_ids)]}, timeout=300)

    threads = [threading.Thread(target=plain_request, args=(i,)) for i in range(IN_FLIGHT // 2)]
    for t in threads:
        t.start()
    streams = [Streamed(url, {**body, "input_ids": prompt_ids[i % len(prompt_ids)]}) for i in range(IN_FLIGHT // 2)]
    steps = {"pause": post(url, "/pause_generation", {"mode": "in_place"})[0],
             "abort_all": post(url, "/abort_request", {"abort_all": True})[0]}
    for s in streams:
        s.drop()
    update: dict = {}
    updater = threading.Thread(target=lambda: update.update(answer=post(
        url, "/update_weights_from_disk", {"model_path": str(swap), "flush_cache": False})))
    updater.start()
    steps["abort_all_during_update"] = post(url, "/abort_request", {"abort_all": True})[0]
    updater.join(300)
    steps["update"] = update.get("answer", (None, "no answer"))[0]
    steps["continue"] = post(url, "/continue_generation", {})[0]
    for t in threads:
        t.join(300)
    finish = [a[1]["meta_info"]["finish_reason"]["type"] if a[0] == 200 else a for a in answers.values()]
    return {"streams": [(s.status, s.first is not None) for s in streams], "steps": steps, "update": update,
            "answered": len(answers), "finish": finish, "record": soak.draft_record(server),
            "health": health(server),
            "after": greedy(server, prompt_ids), "pools": soak.pools(server), "traffic": traffic_info(server)}


def health(server: ServeCommand) -> int | None:
    try:
        with urllib.request.urlopen(server.url + "/health_generate", timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return None


# ---- 3. the server killed while it records traffic -----------------------------------------------------------
def traffic_info(server: ServeCommand) -> dict:
    """The recorder's counters (/server_info sweeps the finished requests into the file first)."""
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]["traffic"]


def recorded_count(server: ServeCommand) -> int:
    return traffic_info(server)["recorded"]


def torn(path: Path) -> bool:
    return path.exists() and not path.read_bytes().endswith(b"\n")


def kill_server_while_recording(server: ServeCommand, prompt_ids, traffic: Path) -> dict:
    recorded = recorded_count(server)
    body = {"sampling_params": {**GREEDY, "max_new_tokens": LONG_NEW}}
    load = [threading.Thread(target=post, args=(server.url, "/generate", {**body, "input_ids": ids}, 60), daemon=True)
            for ids in prompt_ids]
    for t in load:
        t.start()
    crash = post(server.url, "/generate", {"input_ids": prompt_ids[0], "rid": CRASH_RID,
                                           "sampling_params": {**GREEDY, "max_new_tokens": 4}}, timeout=60)
    path = traffic / "samples.jsonl"
    if not torn(path):  # not recorded yet: the next step, or this sweep, records it (and dies)
        try:
            server.get("/server_info", timeout=10)
        except Exception:  # the scheduler died answering it
            pass
    deadline = time.time() + 120
    while time.time() < deadline and not torn(path):
        time.sleep(0.5)
    try:  # kill -9 the whole server, whatever is left of it
        os.killpg(os.getpgid(server.proc.pid), signal.SIGKILL)
    except ProcessLookupError:  # SGLang took itself down when its scheduler died
        pass
    server.proc.wait(timeout=30)
    return {"recorded_before": recorded, "crash_request": crash[0], "data": path.read_bytes(),
            "mode": path.stat().st_mode & 0o777}


@pytest.fixture(scope="module")
def faults(smollm2_dir, tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    target = Path(smollm2_dir)
    work = tmp_path_factory.mktemp("faults")
    tok = AutoTokenizer.from_pretrained(target)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    first = build_random_draft(target, work / "first", seed=0)
    swap = build_random_draft(target, work / "swap", seed=7)
    (swap / "publish.json").write_text(json.dumps({"version": "swap", "step": 7}) + "\n")
    plain = plain_reference(target, first, prompt_ids)
    traffic = work / "traffic"
    override = {"dspark_traffic": {"dir": str(traffic)}, "dspark_pause_lease_s": LEASE_S}
    serve_args = ["--draft", str(first), "--json-model-override-args", json.dumps(override)]
    out = {"plain": plain, "traffic_dir": traffic, "target": target}
    with ServeCommand(target, serve_args=serve_args, env={"DSPARK_SGL_CRASH": f"traffic_write:{CRASH_RID}"},
                      port=port_in()) as server:
        deadline = time.time() + 120
        while "ready to roll" not in server.log() and time.time() < deadline:  # SGLang's warm-up request is done
            time.sleep(0.5)
        out["recorded_at_start"] = recorded_count(server)  # that warm-up request, recorded
        out["before"] = greedy(server, prompt_ids)
        out["idle"] = soak.pools(server)
        out["publish"] = kill_trainer_mid_publish(server, target, work / "trainer", prompt_ids)
        out["abort"] = abort_all_during_swap(server, prompt_ids, swap)
        out["traffic"] = kill_server_while_recording(server, prompt_ids, traffic)
        out["log"] = server.log()[-3000:]
    return out


def test_a_trainer_killed_mid_publish_leaves_the_old_draft_serving_and_the_next_publish_succeeds(faults):
    p = faults["publish"]
    assert p["killed"]["rc"] == -signal.SIGKILL, p["killed"]  # it did die inside the publish
    assert p["after_kill"] == faults["plain"], (p["after_kill"], faults["log"])  # served on, losslessly
    assert p["record_after_kill"]["version"] == p["before"]["version"]  # the old draft
    assert p["record_after_kill"]["swaps"] == p["before"]["swaps"]
    resumed = p["resumed"]
    assert resumed["rc"] == 0 and resumed["results"][0]["success"], resumed
    assert p["record_after_resume"]["version"] == "step-2", p["record_after_resume"]
    assert p["after_resume"] == faults["plain"]


def test_aborting_every_request_during_a_swap_leaves_the_server_healthy_and_lossless(faults):
    a = faults["abort"]
    assert a["streams"] == [(200, True)] * (IN_FLIGHT // 2), a["streams"]  # they were running
    assert a["steps"] == {"pause": 200, "abort_all": 200, "abort_all_during_update": 200, "update": 200,
                          "continue": 200}, (a["steps"], a["update"])
    assert a["answered"] == IN_FLIGHT // 2 and all(f in ("abort", "length") for f in a["finish"]), a["finish"]
    assert "abort" in a["finish"]
    assert a["record"]["version"] == "swap", a["record"]
    assert a["health"] == 200
    assert a["after"] == faults["plain"]
    idle, now = faults["idle"], a["pools"]
    assert (now["kv_free_tokens"], now["req_slots_free"]) == (idle["kv_free_tokens"], idle["req_slots_free"]), (idle,
                                                                                                              now)
    assert a["traffic"]["live"] == 0, a["traffic"]  # the recorder let go of every aborted request too


def test_a_server_killed_while_recording_leaves_whole_records_the_trainer_reads(faults, tmp_path):
    from dspark_sgl.sglang.traffic import TrafficConfig, TrafficRecorder
    from training.data import DataConfig, prepare_samples

    t = faults["traffic"]
    data: bytes = t["data"]
    whole, _, torn = data.rpartition(b"\n")
    assert torn, "the planted crash did not tear the last record"  # the worst point was hit
    with pytest.raises(json.JSONDecodeError):
        json.loads(torn)
    records = [json.loads(line) for line in whole.split(b"\n")]
    assert [r["id"] for r in records] == list(range(len(records)))
    # exactly the requests that finished: the greedy ones (4 calls) and any in-flight one that beat the aborts; no
    # aborted request, no health check (1 token < min_generated)
    finished = 4 * len(PROMPTS) + faults["abort"]["finish"].count("length")
    assert len(records) == t["recorded_before"] == faults["recorded_at_start"] + finished, (
        len(records), t["recorded_before"], faults["recorded_at_start"], finished)
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) and any(r["loss_mask"]) for r in records)
    assert t["mode"] == 0o600

    traffic = faults["traffic_dir"]
    samples, _ = prepare_samples(DataConfig(cache_dir=str(traffic)), faults["target"], traffic, 0, 1, lambda: None,
                                 log=lambda m: None)
    assert [s.id for s in samples] == [r["id"] for r in records]
    assert [s.input_ids for s in samples] == [r["input_ids"] for r in records]

    restarted = TrafficRecorder(TrafficConfig(dir=str(traffic)))  # what the next server does on this folder
    assert restarted.path.read_bytes() == whole + b"\n"
    assert restarted.next_id == len(records)
