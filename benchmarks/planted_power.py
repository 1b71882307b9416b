"""Power of the chi-square tests against the subtle planted bugs (dspark_sgl/faults.py): penalties counted without
the block's earlier drafts, and the top-p boundary shifted by one token.

For each (bug, penalty set, samples n): R seeded repeats of the reference engine's served joint of the first three
tokens on the tiny 6-token target (tests/test_faults.py's setup), each tested against the exact enumeration at the
test's alpha. Power = the fraction of repeats with the bug planted that reject; false-positive rate = the fraction
of clean repeats that reject. Prints a table and writes benchmarks/results/planted_power.json (with provenance).

    python benchmarks/planted_power.py --repeats 8
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.faults import plant
from dspark_sgl.provenance import provenance
from tests.test_faults import ALPHA, PENALTIES, penalty_pvalue, top_p_pvalue

MILD = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)  # tests/test_target_dist.py's set
OUT = Path(__file__).parent / "results" / "planted_power.json"


def cases(big: bool) -> list[dict]:
    """(bug, label, n, p-value function); the 20,000-sample mild case only with --big (~1.5 min a repeat)."""
    rows = [
        dict(bug="penalty_drafts", setting="strong penalties (the tests' set)", n=4000,
             fn=lambda n, s: penalty_pvalue(n, s, PENALTIES)),
        dict(bug="penalty_drafts", setting="mild penalties (test_target_dist's set)", n=4000,
             fn=lambda n, s: penalty_pvalue(n, s, MILD)),
        dict(bug="top_p_boundary", setting="top-p 0.8", n=2000, fn=top_p_pvalue),
        dict(bug="top_p_boundary", setting="top-p 0.8 (the tests' n)", n=4000, fn=top_p_pvalue),
    ]
    if big:
        rows.append(dict(bug="penalty_drafts", setting="mild penalties (test_target_dist's set)", n=20000,
                         fn=lambda n, s: penalty_pvalue(n, s, MILD)))
    return rows


def main(repeats: Annotated[int, typer.Option(help="seeded repeats per case and arm")] = 8,
         big: Annotated[bool, typer.Option(help="also the 20,000-sample mild-penalty case")] = False,
         out: Path = OUT) -> None:
    results = []
    for case in cases(big):
        t0 = time.perf_counter()
        arms = {}
        for arm, name in (("planted", case["bug"]), ("clean", None)):
            with plant(name):
                arms[arm] = [case["fn"](case["n"], 1000 + r) for r in range(repeats)]
        results.append({
            "bug": case["bug"], "setting": case["setting"], "n": case["n"], "repeats": repeats, "alpha": ALPHA,
            "power": sum(p < ALPHA for p in arms["planted"]) / repeats,
            "false_positive_rate": sum(p < ALPHA for p in arms["clean"]) / repeats,
            "pvalues": arms, "seconds": round(time.perf_counter() - t0, 1),
        })
        print(results[-1]["bug"], results[-1]["setting"], results[-1]["n"], results[-1]["power"], flush=True)
    table = Table(title=f"chi-square power against the subtle planted bugs (alpha {ALPHA}, {repeats} seeds each)")
    for col in ("bug", "setting", "samples", "power", "false positives", "s"):
        table.add_column(col)
    for r in results:
        table.add_row(r["bug"], r["setting"], str(r["n"]), f"{r['power']:.3f}", f"{r['false_positive_rate']:.3f}",
                      str(r["seconds"]))
    Console().print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(repeats=repeats, big=big, alpha=ALPHA), "results": results},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
