"""Two "nodes" on 127.0.0.1: a disaggregated target engine and a 2-rank FSDP trainer launched as two separate
`torchrun --nnodes 2 --node-rank 0/1` invocations, hidden states over the gloo pair transport (transport.kind=dist).

Slow (several process starts on a 2-core box). One uninterrupted run is the reference; a second run has its engine
SIGKILLed mid-run (restarted at the same address: the broken pairs are replaced, their keys re-sent), then trainer
rank 1 SIGKILLed mid-run (the job dies; both nodes relaunch with --resume). The resumed run must end with the
reference's weights exactly, and every rank's stream ledger must show each key delivered once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 14, 27]
STEPS = 8


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    return e


def write_recipe(folder: Path, target_dir: Path, data: Path, engine_port: int) -> Path:
    recipe = {
        "target": {"path": str(target_dir), "dtype": "float32"},
        "draft": {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                  "intermediate_size": 128, "block_size": 4, "mask_token_id": 16, "markov_rank": 8,
                  "target_layer_ids": LAYERS},
        "data": {"train": str(data), "max_length": 48},
        "objective": {"num_anchors": 4},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.0},
        # max_batch 1: every capture is the same single-sample prefill, whatever else is queued (bit-exact runs)
        "engine": {"kind": "hf", "placement": "disaggregated", "device": "cpu", "max_batch": 1,
                   "endpoints": [f"tcp://127.0.0.1:{engine_port}"]},
        "stream": {"wire_dtype": "float32", "timeout_s": 20.0, "credits": 2},
        "transport": {"kind": "dist", "host": "127.0.0.1", "backend": "gloo"},
        "train": {"out_dir": str(folder / "run"), "global_batch": 4, "micro_batch": 2, "max_steps": STEPS,
                  "save_every": 1, "compute_dtype": "float32", "progress": False, "threads": 1,
                  "wandb_mode": "disabled", "world_size": 2},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


def start_engine(recipe: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "training.engine_server", "--bind", f"tcp://127.0.0.1:{port}",
                             "--config", str(recipe)], cwd=REPO, env=env(), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def start_node(recipe: Path, node: int, master_port: int, log: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
           "-m", "training", "--config", str(recipe)] + (["--resume"] if resume else [])
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in their own sessions: a group kill misses them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill(p: subprocess.Popen) -> None:
    """SIGKILL a process we started and everything it started."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def kill_worker(node: subprocess.Popen) -> None:
    """SIGKILL the trainer rank (the training process) under a torchrun agent, not the agent."""
    workers = [pid for pid in descendants(node.pid) if b"training" in Path(f"/proc/{pid}/cmdline").read_bytes()
               and b"torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert workers, "no trainer rank under the torchrun agent"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)


def wait_for(log: Path, pattern: str, procs, timeout: float = 400.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and re.search(pattern, log.read_text()):
            return
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {log}:\n{log.read_text()[-3000:] if log.exists() else ''}")


def run_job(recipe: Path, folder: Path, tag: str, resume: bool = False, on_running=None) -> list[str]:
    """Both nodes of one torchrun job; `on_running(nodes)` may kill things. Returns the two node logs."""
    port = free_port()
    logs = [folder / f"{tag}-node{n}.log" for n in (0, 1)]
    nodes = [start_node(recipe, n, port, logs[n], resume) for n in (0, 1)]
    try:
        if on_running is not None:
            on_running(nodes, logs)
        for p in nodes:
            p.wait(timeout=600)
    finally:
        for p in nodes:
            kill(p)
    return [log.read_text() for log in logs]


def ledgers(text: str) -> list[str]:
    return re.findall(r"\[stream\] ledger: .*", text)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # 3 jobs of <= 600 s, 2 waits of <= 400 s
def test_two_nodes_on_loopback_survive_engine_and_trainer_kills_exactly(smollm2_dir, tmp_path):
    from safetensors.torch import load_file

    from training.tiny import tiny_conversations

    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(12)))
    weights = {}

    # the reference: one uninterrupted job
    eport = free_port()
    ref = write_recipe(tmp_path / "ref", smollm2_dir, data, eport)
    engine = start_engine(ref, eport, tmp_path / "ref-engine.log")
    try:
        t0 = time.time()
        logs = run_job(ref, tmp_path, "ref")
        print(f"\nreference 2-node job: {STEPS} steps in {time.time() - t0:.0f}s")
    finally:
        kill(engine)
    assert "exported draft" in logs[0], logs[0][-3000:]
    weights["ref"] = load_file(str(tmp_path / "ref" / "run" / "draft" / "model.safetensors"))

    # the same job, with its engine killed mid-run, then trainer rank 1 killed, then resumed
    eport = free_port()
    rec = write_recipe(tmp_path / "kill", smollm2_dir, data, eport)
    elog = tmp_path / "kill-engine.log"
    engine = [start_engine(rec, eport, elog)]

    def kill_engine_then_rank1(nodes, logs):
        wait_for(logs[0], rf"step 2/{STEPS}", nodes + engine)
        kill(engine[0])  # requests in flight die with it; its pairs break
        print("killed the engine after step 2", flush=True)
        time.sleep(2.0)  # an outage of 2 s, not synchronisation: nothing below depends on its length
        engine[0] = start_engine(rec, eport, elog)
        wait_for(logs[0], rf"step 4/{STEPS}", nodes)
        kill_worker(nodes[1])  # trainer rank 1 (node 1) dies mid-run (in step 5)
        time.sleep(5.0)  # rank 0 left waiting on the dead rank for a while (its length is not asserted on)
        for p in nodes:  # and the job with it, as a cluster scheduler would end it (torchrun would wait 300 s)
            kill(p)
        print("killed trainer node 1 during step 5", flush=True)

    try:
        first = run_job(rec, tmp_path, "kill", on_running=kill_engine_then_rank1)
        resumed = run_job(rec, tmp_path, "resume", resume=True)
    finally:
        kill(engine[0])
    weights["kill"] = load_file(str(tmp_path / "kill" / "run" / "draft" / "model.safetensors"))
    print("\n".join(["--- first job, node 0 (engine killed, then node 1 killed) ---", *first[0].splitlines()[-12:],
                     "--- resumed job, node 0 ---", *resumed[0].splitlines()[-12:],
                     "--- resumed job, node 1 ---", *resumed[1].splitlines()[-4:]]))
    assert f"step {STEPS}/{STEPS}" not in first[0], "the trainer kill came after the end of the run"
    assert "resumed from step" in resumed[0]
    diff = max(float((weights["kill"][k] - weights["ref"][k]).abs().max()) for k in weights["ref"])
    print(f"resumed vs uninterrupted draft weights: max |Δ| {diff:.3g}")
    assert diff == 0.0, "the resumed run did not take exactly the uninterrupted run's updates"
    for text in resumed + logs:
        (line,) = ledgers(text)
        assert " 0 more than once" in line and "0 still wanted" in line, line
    assert re.search(r"[1-9]\d* re-sent", "".join(ledgers(first[0]))), "the engine kill hit no request in flight"
    assert torch.isfinite(next(iter(weights["kill"].values()))).all()
