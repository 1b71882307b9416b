"""Soak (#24): one DSPARK server started by `dspark serve` (CPU, fp32) under a seeded mix of >= 300 requests at
concurrency 16 (benchmarks/soak.py: greedy, sampled, penalties, min-p, seeds, stop strings, n = 2, short and long,
streamed and not, ~10 % cancelled mid-stream, ~5 % over-long prompts, ~2 % custom_logit_processor) with two live
draft swaps (a good draft, then a truncated one), then the seeded HTTP fuzz (benchmarks/http_fuzz.py) against the
same server; then one plain server (`--no-draft --disable-overlap-schedule`) for the greedy reference. "Long"
requests here are 24-32 tokens (the benchmark's 48-96) to keep the cost down.

Cost: two server starts, 300 requests and 220 fuzz cases: 24 min when measured, on 2 cores shared with other jobs
(load average ~9; the DSPARK server got about a third of a core); less on an idle CI box. The longer run:
`python benchmarks/soak.py --minutes 5`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import http_fuzz  # noqa: E402
import soak  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(2400),  # two server starts (<= 600 s each) and the load
]

REQUESTS = 300
FUZZ_CASES = 220


@pytest.fixture(scope="module")
def soaked(smollm2_dir, tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = [tok(p)["input_ids"] for p in soak.PROMPTS]

    def fuzz(server):
        model = server.get("/v1/models")["data"][0]["id"]
        before = http_fuzz.greedy_answers(server, prompt_ids[:2])
        results = http_fuzz.run_fuzz(server.url, model, seed=1, n=FUZZ_CASES)
        return {"failures": http_fuzz.failures(results), "counts": http_fuzz.status_counts(results),
                "same_after": http_fuzz.greedy_answers(server, prompt_ids[:2]) == before}

    return soak.soak(Path(smollm2_dir), prompt_ids, tmp_path_factory.mktemp("soak"), seconds=3600,
                     max_requests=REQUESTS, concurrency=16, seed=0, during=fuzz, long=(24, 32))


def test_nothing_lost_leaked_or_changed(soaked):
    """Every rule of benchmarks/soak.py: all complete, zero 5xx, greedy = plain, swaps 200 then 400 with the good
    draft still serving, KV and request slots back at idle, RSS growth < 5 %."""
    print(soak.summary_line(soaked))
    assert soaked["requests"] >= REQUESTS
    assert soaked["greedy_checked"] >= REQUESTS // 4 and soaked["cancelled"] > 0
    assert not soak.holds(soaked), (soak.holds(soaked), soaked["not_completed"], soaked["log_tail"])


def test_every_fuzz_case_gets_a_4xx_and_the_answers_stay(soaked):
    fuzz = soaked["during"]
    assert sum(fuzz["counts"].values()) == FUZZ_CASES
    assert not fuzz["failures"], fuzz["failures"][:10]
    assert fuzz["same_after"]
