"""Where a measured figure comes from: CPU, git commit, date, library versions, the command and its inputs.

Every result file a benchmark or `dspark eval --json-out` writes carries this record, so a figure quoted in the docs
can be traced to the machine and the code that produced it.
"""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform), with the core count this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = _cpu_flags()
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return f"{name}, {len(_affinity())} cores" + (f" ({'+'.join(bf16)})" if bf16 else " (no native bf16)")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _affinity() -> set[int]:
    try:
        import os

        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(torch.get_num_threads()))


def git_commit() -> str:
    """HEAD of the checkout this code runs from, '+dirty' when it has uncommitted changes ('unknown' outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance(**inputs) -> dict:
    """{cpu, commit, date, python, torch, command, inputs}: the header of every result file."""
    return {
        "cpu": cpu_model(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "inputs": inputs,
    }
