"""Benchmark-only SGLang plugin (`sglang.srt.plugins` entry `dspark_worker_step`, see benchmarks/worker_step.py):
records every decode step of the worker under test into a JSONL file, counted by benchmarks/step_counter.py while
the flag file `<log>.count` exists. Never part of the product: worker_step.py puts a throw-away dist-info that names
this entry point on the server's PYTHONPATH.

Environment: DSPARK_WORKER_STEP_LOG (the JSONL path), DSPARK_WORKER_STEP_WORKER (`ours`, `builtin` or `plain`).
For `builtin`, SGLang's own DSPARK worker runs on a CPU through the one harness-only patch set the project keeps,
dspark_sgl/sglang/cpu/builtin.py (switched on by worker_step.py's server environment), as in sglang_speed.py.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_counter import StepCounter  # noqa: E402

ENTRY = "dspark_worker_step"


ACTIVE: list[StepCounter] = []  # the counter of the step being counted, if any
COPIED = WeakIdKeyDictionary()  # result tensors SGLang has copied to the host (copy_to_cpu): host-side from then on


class StepLog:
    """Appends one JSON line per decode step; a step is steady when the batch holds the same requests as the last."""

    def __init__(self, path: str, worker: str):
        self.path, self.worker = Path(path), worker
        self.flag = Path(path + ".count")
        self.last_key: tuple | None = None

    def run(self, step, batch, host_tensors):
        key = tuple(r.rid for r in batch.reqs)
        steady, self.last_key = key == self.last_key, key
        count = self.flag.exists()
        if batch.seq_lens_cpu is not None and batch.seq_lens_cpu is batch.seq_lens:
            # on a CPU SGLang's `seq_lens.to("cpu")` is the tensor itself; on CUDA it is a host copy: make it one
            batch.seq_lens_cpu = batch.seq_lens.clone()
            host_tensors = [batch.seq_lens_cpu, *host_tensors[1:]]
        host = [t for t in host_tensors if t is not None and t is not batch.seq_lens]
        t0 = time.perf_counter()
        if count:
            with StepCounter(host) as counter, counter.wrapped_reads():
                ACTIVE.append(counter)
                try:
                    out = step()
                finally:
                    ACTIVE.pop()
        else:
            out = step()
        ms = (time.perf_counter() - t0) * 1e3
        rec = {"worker": self.worker, "bs": len(key), "steady": steady, "counted": count, "ms": ms}
        if count:
            rec.update(ops=counter.ops["worker"], bytes=counter.bytes["worker"], syncs=counter.num_syncs("worker"),
                       sync_ops=dict(counter.syncs["worker"]), target_ops=counter.ops["target"],
                       target_bytes=counter.bytes["target"], target_syncs=counter.num_syncs("target"),
                       target_sync_ops=dict(counter.syncs["target"]), sync_sites=dict(counter.sites),
                       standin_syncs=counter.num_syncs("standin"))
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        return out


def _host_tensors(batch) -> list:
    """What a step may read without a sync: SGLang's host-side copies of the batch's lengths, and the fields of
    earlier step results that SGLang copied to the host (on a CPU that copy is the tensor itself)."""
    spec = batch.spec_info
    return list(itertools.chain([batch.seq_lens_cpu, getattr(spec, "nxt_kv_lens_cpu", None)], COPIED.keys()))


def _track_host_copies() -> None:
    from sglang.srt.managers.utils import GenerationBatchResult

    orig = GenerationBatchResult.copy_to_cpu

    @functools.wraps(orig)
    def copy_to_cpu(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        for t in (self.next_token_ids, self.accept_lens, self.block_accept_lens, self.cap_lens):
            if t is not None:
                COPIED[t] = True
        return out

    GenerationBatchResult.copy_to_cpu = copy_to_cpu


def _wrap_target_forward() -> None:
    """Ops inside the target model's forward are counted apart: it is SGLang's, the same for every worker (on a CPU
    its torch_native attention reads lengths per request, which a CUDA backend does not)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    orig = ModelRunner.forward

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        if not ACTIVE:
            return orig(self, *args, **kwargs)
        with ACTIVE[-1].in_section("target"):
            return orig(self, *args, **kwargs)

    ModelRunner.forward = forward


def _wrap_decode(cls, log: StepLog) -> None:
    orig = cls._forward_decode

    @functools.wraps(orig)
    def forward_decode(self, batch, *args, **kwargs):
        return log.run(lambda: orig(self, batch, *args, **kwargs), batch, _host_tensors(batch))

    cls._forward_decode = forward_decode


def _wrap_plain(log: StepLog) -> None:
    from sglang.srt.managers.tp_worker import TpModelWorker

    orig = TpModelWorker.forward_batch_generation

    @functools.wraps(orig)
    def forward(self, batch=None, *args, **kwargs):
        if batch is None or not batch.forward_mode.is_decode():
            return orig(self, batch, *args, **kwargs)
        return log.run(lambda: orig(self, batch, *args, **kwargs), batch, _host_tensors(batch))

    TpModelWorker.forward_batch_generation = forward


def load() -> None:
    path, worker = os.environ.get("DSPARK_WORKER_STEP_LOG"), os.environ.get("DSPARK_WORKER_STEP_WORKER", "ours")
    if not path:
        return
    log = StepLog(path, worker)
    _wrap_target_forward()
    _track_host_copies()
    if worker == "ours":
        from dspark_sgl.sglang.worker import DSparkWorker

        _wrap_decode(DSparkWorker, log)
    elif worker == "builtin":
        from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2

        _wrap_decode(DSparkWorkerV2, log)
    elif worker == "plain":
        _wrap_plain(log)
    else:
        raise ValueError(f"DSPARK_WORKER_STEP_WORKER={worker!r}; expected ours, builtin or plain")
