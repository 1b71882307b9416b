"""Planted bugs in the served worker (real SGLang 0.5.23, CPU, fp32): each served check passes on a clean DSPARK
server and FAILS on a server started with DSPARK_SGL_PLANT=<name> (dspark_sgl/faults.py, test-only).

Target: the tiny random 8-token Llama (tests/sglang_cpu/dspark_testkit.py), cheap enough for thousands of served
samples. Draft: `build_random_draft`, a random fp32 draft (every weight N(0, 0.5)) with a reduced vocabulary (7 of
8 tokens, d2t) plus the bigram table of the target's greedy outputs in its Markov head. Its proposals depend on the
backbone, the draft context, positions and the previous token, unlike the near-zero-norm oracle of the other served
tests, so a wrong context write or Markov order changes the accept counts. The checks:
    accept_hist  - T = 0, static schedule: each request's output AND per-step accepted-count histogram equal the
                   reference engine's (dspark_sgl.speculative.engine) on the same target and draft
    stale        - after a live swap (/update_weights_from_disk, same folder) a request whose radix-cached prefix
                   (held by a running request) has the old epoch's context verifies the anchor alone: 0 accepted
    penalties    - T = 0 with strong repetition/frequency/presence penalties: token-identical to the exact definition
                   (test_sglang_sampling.exact_greedy). At 3,000 served samples on this target a chi-square did not
                   catch penalty_drafts (p = 0.37); tests/test_faults.py's chi-square does (power 1.0)
    chi-square   - the joint of the first 3 sampled tokens (top-p 0.8; T = 1 through the d2t path) vs the exact
                   enumeration with the shared definition, p > 1e-4 as in test_sglang_sampling.py
    seed         - a seeded request repeats its output alone and in a crowd (given the same prefill token)
    hybrid       - (hybrid_commit, hybrid_state) the Kimi-Linear hybrid's greedy output equals plain SGLang's; the
                   clean side of this one is tests/test_sglang_hybrid.py::test_static_full_window_commits_are_exact
kv_rollback has no worker site (SGLang's allocator owns the target KV); tests/test_faults.py covers it.

One clean server runs every probe; each planted server runs only the probe of its own check. Cost on the 2-core box:
see docs/testing.md (measured, printed at the end of the module).
Run: DSPARK_SGL_VENV=... DSPARK_REQUIRE_SGLANG=1 pytest -m planted tests/test_sglang_planted.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import Server, build_random_draft, build_tiny_target  # noqa: E402

from dspark_sgl.faults import ENV  # noqa: E402
from tests.test_sampling import chi2_pvalue  # noqa: E402
from tests.test_sglang_sampling import PROMPT, PROMPTS, counts, exact_greedy, exact_joint, generate  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.planted, pytest.mark.timeout(1800)]

V, GAMMA, MAX_NEW = 8, 3, 24
DRAFT_VOCAB = [1, 2, 3, 4, 5, 6, 7]  # token 0 is outside: the d2t map is not the identity
ALPHA = 1e-4  # test_sglang_sampling.py's threshold
PENALTIES = dict(repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0)
SAMPLED = {  # check -> (sampling params, served samples)
    "top_p": (dict(temperature=1.0, top_p=0.8), 3000),
    "d2t": (dict(temperature=1.0), 3000),
}
SEED_PARAMS = dict(temperature=1.0, sampling_seed=4321)
PLANT_PROBE = {  # planted bug -> the probe (and check) that must catch it
    "verify_limit": "accept_hist", "context_keep": "accept_hist", "markov_prev": "accept_hist", "stale_cap": "stale",
    "penalty_drafts": "greedy_penalties", "top_p_boundary": "top_p", "d2t_sampled": "d2t", "seed": "seed",
}
PORTS = iter(range(int(os.environ.get("DSPARK_TEST_PORT", "32600")), 65536))
COST: dict[str, float] = {}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target", vocab=V)


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory) -> dict:
    """The draft (bigram of the target's greedy outputs, computed in-process) and the reference engine's T = 0
    outputs and accept histograms on PROMPTS."""
    from dspark_sgl.model.checkpoint import load_draft
    from dspark_sgl.speculative.engine import SpecEngine
    from dspark_sgl.targets import HFTarget

    hf = HFTarget.from_pretrained(target, [0, 1, 2])
    plain = SpecEngine(hf).generate(PROMPTS, MAX_NEW)
    seqs = [p + o.token_ids for p, o in zip(PROMPTS, plain, strict=True)]
    draft = build_random_draft(target, tmp_path_factory.mktemp("draft") / "random", block_size=GAMMA, std=0.5,
                               draft_vocab=DRAFT_VOCAB, sequences=seqs, scale=3.0, target_layer_ids=[0, 1, 2])
    out = SpecEngine(hf, load_draft(draft)).generate(PROMPTS, MAX_NEW)
    return {"draft": draft, "outputs": [o.token_ids for o in out], "hists": [o.stats.accept_hist for o in out]}


def probe(server: Server, name: str, draft: Path) -> dict:
    """What one check needs from a running server."""
    if name == "accept_hist":
        outs = server.generate(PROMPTS, MAX_NEW, ignore_eos=True)
        return {"outputs": [o["output_ids"] for o in outs],
                "hists": [o["meta_info"]["spec_correct_drafts_histogram"] for o in outs]}
    if name == "stale":
        return stale_probe(server, draft)
    if name == "greedy_penalties":
        return {"outputs": generate(server, PROMPTS, [{"temperature": 0.0, **PENALTIES}] * len(PROMPTS), MAX_NEW)}
    if name in SAMPLED:
        params, n = SAMPLED[name]
        return {"samples": generate(server, [PROMPT] * n, [params] * n, 3)}
    if name == "seed":
        alone = [generate(server, [PROMPT], [SEED_PARAMS], 16)[0] for _ in range(6)]
        crowd = [generate(server, [[2, 2], PROMPT, [6]], [{"temperature": 0.8}, SEED_PARAMS, {}], 16)[1]
                 for _ in range(6)]
        return {"outputs": alone + crowd}
    raise KeyError(name)


def info(server: Server) -> dict:
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]


def stale_probe(server: Server, draft: Path) -> dict:
    """A long request holds PROMPTS[0]'s prefix in the radix cache (evict_unused_prefixes keeps what a running
    request holds); once it is decoding (the server's decode-step counter moves: no sleep as synchronisation), a
    live swap (same folder) inside /pause_generation (in place) .. /continue_generation makes that context stale,
    and a second request on the same prompt reuses it: it must verify the anchor alone, step after step."""
    long = threading.Thread(target=server.generate, args=([PROMPTS[0]], 480), kwargs={"ignore_eos": True})
    steps = info(server)["decode_steps"]
    long.start()
    deadline = time.time() + 120
    while info(server)["decode_steps"] < steps + 3 and time.time() < deadline:
        time.sleep(0.05)
    server.post("/pause_generation", {"mode": "in_place"})  # else the update waits for the running request to end
    server.post("/update_weights_from_disk", {"model_path": str(draft)})
    server.post("/continue_generation", {})
    again = server.generate([PROMPTS[0]], MAX_NEW, ignore_eos=True)[0]
    server.post("/abort_request", {"abort_all": True})
    long.join(timeout=300)
    return {"hist": again["meta_info"]["spec_correct_drafts_histogram"],
            "stale_rows": info(server)["draft_update"]["stale_rows"]}


def check(name: str, got: dict, target: Path, reference: dict) -> tuple[bool, str]:
    """(passed, detail) of one served check on a probe's results."""
    if name == "accept_hist":
        same_out = got["outputs"] == reference["outputs"]
        same = [g + [0] * (GAMMA + 1 - len(g)) == r
                for g, r in zip(got["hists"], reference["hists"], strict=True)]
        return same_out and all(same), f"outputs equal {same_out}, histograms equal {sum(same)}/{len(same)}"
    if name == "stale":
        accepted = sum(c * n for c, n in enumerate(got["hist"]))
        return accepted == 0 and got["stale_rows"] > 0, (
            f"drafts accepted by the request on stale context {accepted} in {sum(got['hist'])} steps; "
            f"stale request-steps {got['stale_rows']}")
    if name == "greedy_penalties":
        exact = exact_greedy(target, {"temperature": 0.0, **PENALTIES}, MAX_NEW)
        same = [o == e for o, e in zip(got["outputs"], exact, strict=True)]
        return all(same), f"= the exact definition {sum(same)}/{len(same)}"
    if name in SAMPLED:
        p = chi2_pvalue(counts(got["samples"]), exact_joint(target, SAMPLED[name][0]))
        return p > ALPHA, f"p = {p:.3g}"
    if name == "seed":
        by_first: dict[int, set] = {}
        for out in got["outputs"]:
            by_first.setdefault(out[0], set()).add(tuple(out))
        sizes = [len(v) for v in by_first.values()]
        return all(n == 1 for n in sizes), f"distinct outputs per first token {sizes}"
    raise KeyError(name)


def serve(target: Path, draft: Path, plant: str | None) -> Server:
    args = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft), "--random-seed", "2"]
    env = {"SGLANG_RAGGED_VERIFY_MODE": "static", **({ENV: plant} if plant else {})}
    return Server(target, args, env=env, port=next(PORTS))


CLEAN_PROBES = ["accept_hist", "seed", "stale", "greedy_penalties", *SAMPLED]  # the order the clean server runs them


@pytest.fixture(scope="module")
def clean(request, target, reference) -> dict:
    """One clean server runs the probes of the selected clean tests (CI selects a few with -k), then stops: an idle
    SGLang server keeps a core busy, so it must not outlive its probes while the planted servers run."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.originalname == "test_the_clean_server_passes"}
    t0 = time.perf_counter()
    with serve(target, reference["draft"], None) as s:
        res = {name: probe(s, name, reference["draft"]) for name in CLEAN_PROBES if name in wanted}
    COST["clean"] = time.perf_counter() - t0
    return res


@pytest.mark.parametrize("name", CLEAN_PROBES)
def test_the_clean_server_passes(clean, target, reference, name):
    ok, detail = check(name, clean[name], target, reference)
    print(f"clean {name}: {detail}")
    assert ok, detail


@pytest.mark.parametrize("plant", list(PLANT_PROBE))
def test_the_planted_server_fails(target, reference, plant):
    name = PLANT_PROBE[plant]
    t0 = time.perf_counter()
    with serve(target, reference["draft"], plant) as s:
        got = probe(s, name, reference["draft"])
    COST[plant] = time.perf_counter() - t0
    ok, detail = check(name, got, target, reference)
    print(f"planted {plant} -> {name}: {detail}")
    assert not ok, f"{plant} planted and {name} still passes: {detail}"


def test_hybrid_state_plants_are_caught(smollm2_dir, tmp_path_factory):
    """Two plants on the hybrid target's recurrent state, each caught by greedy output != plain SGLang's: the state
    committed for c + 2 tokens (hybrid_commit), and the state zeroed after every commit (hybrid_state: shows that
    the served output depends on the KDA state at all). One plain server serves both."""
    from dspark_testkit import build_bigram_draft
    from tiny_hybrid import HYBRID_SERVER_ARGS, HYBRID_SERVER_ENV, build_tiny_kimi_linear
    from transformers import AutoTokenizer

    from tests.test_sglang_hybrid import GAMMA as HG
    from tests.test_sglang_hybrid import MAX_NEW as HN
    from tests.test_sglang_hybrid import PROMPTS as HP

    t0 = time.perf_counter()
    tgt = build_tiny_kimi_linear(tmp_path_factory.mktemp("hybrid") / "kimi_linear_tiny", smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tok(p)["input_ids"] for p in HP]
    with Server(tgt, list(HYBRID_SERVER_ARGS), dict(HYBRID_SERVER_ENV), port=next(PORTS)) as s:
        plain = [o["output_ids"] for o in s.generate(ids, HN)]
    COST["hybrid plain"] = time.perf_counter() - t0
    draft = build_bigram_draft(tgt, [p + o for p, o in zip(ids, plain, strict=True)],
                               tmp_path_factory.mktemp("hdraft") / "bigram", block_size=HG, target_layer_ids=[0, 1, 2])
    args = [*HYBRID_SERVER_ARGS, "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
            "--speculative-dspark-block-size", str(HG)]
    same = {}
    for plant_name in ("hybrid_commit", "hybrid_state"):
        t0 = time.perf_counter()
        env = {**HYBRID_SERVER_ENV, "SGLANG_RAGGED_VERIFY_MODE": "static", ENV: plant_name}
        with Server(tgt, args, env, port=next(PORTS)) as s:
            outs = [o["output_ids"] for o in s.generate(ids, HN)]
        COST[plant_name] = time.perf_counter() - t0
        same[plant_name] = sum(a == b for a, b in zip(outs, plain, strict=True))
        print(f"planted {plant_name}: identical to plain {same[plant_name]}/{len(plain)}")
    assert all(n < len(plain) for n in same.values()), same


def test_zz_cost():
    """The module's wall time per server (start + probes), for docs/testing.md."""
    print("planted served cost (s):", {k: round(v, 1) for k, v in COST.items()}, "total", round(sum(COST.values())))
