"""`dspark serve` on CPU, end to end: real SGLang 0.5.23 behind the OpenAI endpoint, plain, DSPARK and SGLang's NGRAM.

Every server here is started by the product command (not the test kit's bare launch_server), with the pure-torch
`sgl_kernel` stand-ins it picks for this CPU. fp32, T = 0: DSPARK and NGRAM must return exactly plain decoding's
tokens, one request at a time and 4 concurrent. Target: SmolLM2-135M; draft: the bigram draft of the test kit (built
from the plain outputs, so it is accepted). Servers stop as soon as the module is done.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft, sglang_python  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # a test may start 2 servers (<= 600 s each) before its requests
]

MAX_NEW = 40
CHAT = "Count from 1 to 12, separated by commas."
PROMPTS = [
    "1, 2, 3, 4, 5, 6,",
    "Monday, Tuesday, Wednesday,",
    "def fibonacci(n):",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


def _outputs(server: ServeCommand, prompt_ids: list[list[int]]) -> dict:
    """Greedy outputs one at a time and all concurrently, the accept lengths, and one chat completion."""
    server.post("/flush_cache", {})  # also resets NGRAM's corpus
    single = [server.generate([ids], MAX_NEW)[0] for ids in prompt_ids]
    batched = server.generate(prompt_ids, MAX_NEW)
    chat = server.chat(CHAT, MAX_NEW)
    print(f"{server.serve_args}: /v1/chat/completions -> {chat['choices'][0]['message']}")  # shown with -s
    return {"single": [o["output_ids"] for o in single], "batched": [o["output_ids"] for o in batched],
            "accept": [o["meta_info"].get("spec_accept_length") for o in single], "chat": chat}


@pytest.fixture(scope="module")
def plain(smollm2_dir, prompt_ids) -> dict:
    with ServeCommand(smollm2_dir, serve_args=["--no-draft"]) as s:
        return _outputs(s, prompt_ids)


def test_plain_serve_answers_through_the_openai_endpoint(plain):
    reply = plain["chat"]
    msg = reply["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].strip()
    assert reply["usage"]["completion_tokens"] > 0
    assert plain["single"] == plain["batched"]  # fp32: batch shape does not change the tokens


def test_dspark_serve_is_lossless_and_uses_the_draft(smollm2_dir, prompt_ids, plain, tmp_path_factory):
    seqs = [p + o for p, o in zip(prompt_ids, plain["single"], strict=True)]
    draft = build_bigram_draft(smollm2_dir, seqs, tmp_path_factory.mktemp("draft") / "bigram")
    cache = tmp_path_factory.mktemp("sps-cache")  # the per-machine cost cache, on as for an operator
    args, env = ["--draft", str(draft)], {"DSPARK_SGL_SPS_CACHE": str(cache)}
    # `dspark profile-costs` with the serve command's flags measures the costs before serving (both arms, buckets 1
    # and 2, interleaved rounds): the table is in the cache before any request, and `dspark serve` loads it
    cmd = [sys.executable, "-m", "dspark_sgl.cli", "profile-costs", "--python", str(sglang_python()), "--target",
           str(smollm2_dir), "--dtype", "float32", *args, "--batch-size", "1", "--batch-size", "2", "--repeats", "2",
           "--new-tokens", "8", "--log", str(cache.parent / "profile.log")]
    profile_env = ServeCommand(smollm2_dir, serve_args=args, env=env).process_env()
    done = subprocess.run(cmd, env=profile_env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (file,) = cache.glob("*.json")
    profiled = json.loads(file.read_text())
    for b in ("1", "2"):
        costs = profiled["buckets"][b]
        assert len(costs["off"]) >= 5 and len(costs["draft"]) >= 5 and costs["after"][-1], (b, costs)
    with ServeCommand(smollm2_dir, serve_args=args, env=env) as s:
        out = _outputs(s, prompt_ids)
        assert f"buckets [1, 2] loaded from {file}" in s.log(), s.log()[-3000:]
    assert out["single"] == plain["single"] and out["batched"] == plain["batched"]
    assert out["chat"]["choices"][0]["message"]["content"] == plain["chat"]["choices"][0]["message"]["content"]
    print(f"dspark serve, confidence schedule: accept lengths {out['accept']}")
    # the draft really proposed tokens: expected mean ≈ 2.5 (3.08, 3.08, 2.35, 1.67 in the CI rehearsal of 2026-12-04,
    # 2-core Xeon); a floor because the confidence schedule trims by this box's measured SPS table
    assert sum(out["accept"]) / len(out["accept"]) > 1.2, out["accept"]

    # The step costs corrected on the way (the served steps' own timings) are kept for this engine; a restart loads
    # them. The restart runs `--speculate match` (never draft; an off step verifies the request's matches from its own
    # text where the loaded costs say they pay): match steps, with no draft row at all, and the same tokens.
    saved = json.loads(file.read_text())
    assert len(saved["buckets"]) > 2, saved["buckets"].keys()  # 4 concurrent requests ran: a bucket not profiled
    # Whether a match step pays is this box's timing: on stop 46's CI box the learnt table let one match step run (it
    # accepted 0; the request's estimate fell and no later match paid by that table). The restart loads a
    # table whose verifies cost one plain step at every width (SGLang's CPU path: a verify costs no more than a plain
    # decode), so that any match surviving > 5 % pays by the rule: what is tested is that the mode runs those steps,
    # never drafts, reads the table from the cache, and keeps the tokens. (The served steps still correct the table.)
    for costs in saved["buckets"].values():
        costs["after"] = [costs["after"][0]] + [list(costs["off"]) for _ in costs["after"][1:]]
    file.write_text(json.dumps(saved))
    with ServeCommand(smollm2_dir, serve_args=[*args, "--speculate", "match"], env=env) as s:
        again = [s.generate([ids], MAX_NEW)[0]["output_ids"] for ids in prompt_ids[:2]]
        info = s.get("/server_info")["internal_states"][0]["dspark_info_record"]
        log = s.log()
    assert again == plain["single"][:2]
    assert f"loaded from {file}" in log and "learnt from the served steps" not in log, log[-3000:]
    assert "1" in info["rule"] and info["sps_table"] is None and info["decode_steps"] > 0
    print(f"--speculate match: bucket 1 {info['buckets']['1']}, match counters {info['match']}")
    assert info["buckets"]["1"]["match_step_share"] > 0 and info["match"]["steps"]["draft"] == 0, info
    assert info["match"]["accepted"]["match"] > 0, info["match"]


def test_ngram_serve_is_lossless(smollm2_dir, prompt_ids, plain):
    args = ["--no-draft", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    with ServeCommand(smollm2_dir, serve_args=args) as s:
        out = _outputs(s, prompt_ids)
    assert out["single"] == plain["single"] and out["batched"] == plain["batched"]
    assert out["chat"]["choices"][0]["message"]["content"] == plain["chat"]["choices"][0]["message"]["content"]
    assert max(out["accept"]) > 1.0, out["accept"]  # the counting prompt repeats itself: NGRAM drafts are accepted
