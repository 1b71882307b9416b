"""Real SGLang on a CPU: pure-torch `sgl_kernel` ops, an import-only torchvision, verify-capable torch_native attention.

`server_env` is the one place that decides what a CPU server process gets: each stand-in folder goes on PYTHONPATH
only when the real module does not import in that interpreter (PyPI's sgl_kernel and torchvision need CUDA), so a CUDA
install never sees them. The attention shim is the `dspark_cpu` entry point of `sglang.srt.plugins` (attention.py).
Importing this package imports neither sglang nor torch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDINS = {"sgl_kernel": HERE / "path_sgl_kernel", "torchvision": HERE / "path_torchvision"}
PLUGIN_ENTRY_POINTS = ("dspark", "dspark_cpu")  # both must be in the interpreter's installed metadata
# SGLang on a CPU (server flags and sglang.Engine keywords alike): torch attention, no CUDA graphs, a KV pool capped by
# max_total_tokens. The static fraction only sets how much of the RAM free at start-up must still be free once the
# weights are loaded, so 0.5 tolerates other processes on a shared machine. fp32 is what keeps T = 0 lossless here
# (bf16 results depend on batch shape); the dtype is the caller's. sleep_on_idle: an idle SGLang scheduler otherwise
# polls its sockets in a busy loop (SGLang's IdleSleeper docstring: "each GPU would otherwise pin one thread at 100%
# CPU"); on a CPU server that thread is taken from the model's own cores, and every idle server on the host slows the
# busy ones (measured on the 2-core Xeon: an idle SmolLM2 server took 20.0 s of CPU in 20 s without it, < 1 s with it).
# With it the loop blocks in zmq.Poller.poll until a request arrives (no added latency: the poll wakes on the socket).
SGLANG_CPU_ARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                       max_total_tokens=8192, mem_fraction_static=0.5, sleep_on_idle=True)


def cpu_server_flags() -> list[str]:
    """SGLANG_CPU_ARGS as `launch_server` flags."""
    flags = []
    for key, value in SGLANG_CPU_ARGS.items():
        flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags

_PROBE = """
import importlib, json, sys
from importlib.metadata import entry_points, version
out = {"missing": [], "sglang": None, "plugins": sorted(e.name for e in entry_points(group="sglang.srt.plugins"))}
for name in %r:
    try:
        importlib.import_module(name)
    except Exception:
        out["missing"].append(name)
try:
    out["sglang"] = version("sglang")
except Exception:
    pass
print(json.dumps(out))
"""


def _user_pythonpath(env: dict[str, str]) -> str:
    standins = {str(p) for p in STANDINS.values()}
    return os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in standins)


def probe(python: str | Path, env: dict[str, str] | None = None) -> dict:
    """What `python` has: {"sglang": version or None, "missing": stand-in modules that fail to import, "plugins"}."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = _user_pythonpath(env)  # the caller's own code, never a stand-in
    res = subprocess.run([str(python), "-c", _PROBE % (tuple(STANDINS),)], capture_output=True, text=True, env=env,
                         cwd="/tmp", timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"{python} could not be probed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def tp_size_of(args: list[str]) -> int:
    """The --tp-size (or --tensor-parallel-size) in a launch_server argument list; the last one wins, as in argparse."""
    tp = 1
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--tp-size", "--tensor-parallel-size", "--tp"):
            tp = int(value or args[i + 1])
    return tp


def omp_bind(tp_size: int, cores: list[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `tp_size` ranks: this process's cores in `tp_size` equal runs, "0-3|4-7" ("0|1").

    SGLang's CPU TP asserts one NUMA node per rank unless this names each rank's cores (utils/numa_utils.py
    init_threads_binding); a 2-core, one-node box runs TP=2 only with it."""
    cores = sorted(cores)
    if tp_size > len(cores):
        raise ValueError(f"--tp-size {tp_size} on a CPU needs a core per rank; this process may use {len(cores)}")
    per = len(cores) // tp_size
    runs = [cores[r * per:(r + 1) * per] for r in range(tp_size)]
    return "|".join(f"{r[0]}-{r[-1]}" if len(r) > 1 and r[-1] - r[0] == len(r) - 1 else ",".join(map(str, r))
                    for r in runs)


def server_env(python: str | Path, base: dict[str, str] | None = None, facts: dict | None = None,
               tp_size: int = 1) -> dict[str, str]:
    """Environment for a CPU SGLang process run by `python`: SGLang's CPU engine switch plus the stand-ins it lacks,
    and with TP the cores of each rank (unless the caller names them).

    `facts` is a `probe(python)` answer already in hand (saves a second interpreter start).
    """
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang imports vllm's rotary embedding
    env.setdefault("OMP_NUM_THREADS", "1")
    if tp_size > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", omp_bind(tp_size, list(os.sched_getaffinity(0))))
    facts = facts or probe(python, env)
    paths = [str(STANDINS[name]) for name in facts["missing"]]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, _user_pythonpath(env)) if p)
    return env
