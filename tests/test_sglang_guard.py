"""One request never takes a served SGLang down (#24): `dspark serve` servers, real SGLang 0.5.23 on CPU.

Plain SGLang 0.5.23 passes a few values unchecked to its scheduler, whose exception then ends the whole server (each
case below marked `crash` was seen to do so without dspark_sgl.sglang.guard). Against one plain (`--no-draft`) and
one DSPARK server, each started once by the product command: every bad request gets a 4xx whose message names the
problem, and afterwards the server still answers greedy requests token-identically to its answers before the fuzz.
Both servers run with SGLang's --admin-api-key, so the trainer's draft push is checked there too: refused (401)
without the key, installed with it (DSPARK). Both also run with `--draft-root` (the draft's folder): a disk update
through a symlink in the root pointing out, or a `..` out of it, is refused (400) even with the key, and nothing
changes (no swap; the answers stay the same). Cost: four more short admin calls, no server start.
The guard is one plugin hook whatever the speculative algorithm; NGRAM's server is checked through that hook in
tests/test_sglang_plugin.py instead of a third server start. The validation itself: tests/test_guard.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.timeout(1500),  # two server starts (<= 600 s each) and ~20 short requests
]

MAX_NEW = 16
PROMPTS = ["1, 2, 3, 4, 5, 6,", "def fibonacci(n):"]
CHAT = "Name three colours."
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
GEN, CMP, CHAT_PATH = "/generate", "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# (what, path, body, words the error message must contain); `crash`: plain SGLang 0.5.23's scheduler died on it
BAD = [
    ("crash: prompt ids out of range", GEN, {"input_ids": [1_000_000_000, -1], "sampling_params": GREEDY},
     "input_ids[0] = 1000000000 is out of range"),
    ("crash: an empty prompt in a batch", GEN, {"input_ids": [[]], "sampling_params": GREEDY}, "input_ids is empty"),
    ("crash: logprob_start_len below -1", GEN, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -7,
                                                "sampling_params": GREEDY}, "logprob_start_len = -7"),
    ("crash: top_logprobs_num above the vocabulary", GEN,
     {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10**6, "sampling_params": GREEDY},
     "top_logprobs_num = 1000000 must be in [0, 49152]"),
    ("crash: stop token out of range with min_new_tokens", GEN,
     {"input_ids": [1, 2], "sampling_params": {**GREEDY, "stop_token_ids": [10**9], "min_new_tokens": 2}},
     "stop_token_ids[0] = 1000000000 is out of range"),
    ("crash: top_k overflowing int32 (found by a seeded fuzz)", GEN,
     {"input_ids": [1, 2], "sampling_params": {**GREEDY, "top_k": 2**31}}, "top_k = 2147483648 is too large"),
    ("crash: return_hidden_states neither a boolean nor 'last' (found by a seeded fuzz)", GEN,
     {"input_ids": [1, 2], "return_hidden_states": [], "sampling_params": GREEDY},
     "return_hidden_states = [] must be true, false or"),
    ("negative stop token", GEN, {"input_ids": [1, 2], "sampling_params": {**GREEDY, "stop_token_ids": [-5]}},
     "stop_token_ids[0] = -5 is out of range"),
    ("a prompt id out of range in a batch with n = 3", GEN,
     {"input_ids": [[1, 2], [3, 49152]], "sampling_params": {**GREEDY, "n": 3}}, "input_ids[1] = 49152"),
    # n: the bound itself (unguarded, n = 8192 kept a CPU server past its health check, n = 10**9 never answered;
    # too costly to send to a server that might not refuse them)
    ("n = 129 through the OpenAI completion", CMP, {"prompt": [1, 2], "max_tokens": 2, "n": 129},
     "n = 129 must be an integer in [1, 128]"),
    ("negative n in a batch (a 500 before)", GEN,
     {"input_ids": [[1], [2, 3]], "sampling_params": {**GREEDY, "n": -2}}, "n = -2 must be"),
    ("fewer sampling_params than prompts (a 500 before)", GEN,
     {"input_ids": [[1, 2], [3, 4]], "sampling_params": [GREEDY]}, "sampling_params has 1 entries for 2 prompts"),
    ("crash: an empty text prompt", GEN, {"text": "", "sampling_params": GREEDY}, "input_ids is empty"),
    ("500 before: stop_regex not a regular expression", GEN,
     {"input_ids": [1, 2], "sampling_params": {**GREEDY, "stop_regex": "("}}, "stop_regex '(' is not a regular"),
    ("OpenAI completion with token ids out of range", CMP, {"prompt": [1_000_000_000, -1], "max_tokens": 4},
     "input_ids[0] = 1000000000 is out of range"),
    ("OpenAI completion logprobs above the vocabulary", CMP, {"prompt": "hi", "max_tokens": 2, "logprobs": 100000},
     "top_logprobs_num = 100000"),
    ("OpenAI chat stop token out of range", CHAT_PATH,
     {"messages": MSG, "max_tokens": 2, "stop_token_ids": [-3], "min_tokens": 1}, "stop_token_ids[0] = -3"),
    # SGLang's own checks, kept so that the guard is seen not to shadow them
    ("top_p above 1", GEN, {"input_ids": [1, 2], "sampling_params": {**GREEDY, "top_p": 2.0}}, "top_p must be in"),
    ("negative max_new_tokens", GEN, {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": -5}},
     "max_new_tokens must be at least 0"),
    ("huge max_new_tokens", GEN, {"input_ids": [1, 2], "sampling_params": {**GREEDY, "max_new_tokens": 10**12}},
     "maximum context length"),
]
ADMIN_KEY = "test-admin-key"  # both servers start with --admin-api-key: the trainer's push must carry it
# The tensor and distributed draft-update calls, sent with a body SGLang cannot parse: without the key the auth gate
# answers 401; with it the call gets past the gate to SGLang's request parsing (400 `Field required`), so
# nothing is ever updated.
UPDATE_CALLS = ["/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed"]
DISK = "/update_weights_from_disk"
STREAMED_BAD = {"input_ids": [5, 1_000_000_000], "stream": True, "sampling_params": GREEDY}  # SGLang: 200 + error event


def send(server: ServeCommand, path: str, body: dict, key: str | None = None) -> tuple[int | None, str]:
    """(HTTP status, the error message or body); (None, the exception) when the server did not answer."""
    try:
        if path.startswith("/v1/"):
            body = {"model": server.get("/v1/models")["data"][0]["id"], **body}
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:
            err = json.loads(raw)
        except json.JSONDecodeError:
            return e.code, raw
        err = err.get("error", err)
        return e.code, err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except Exception as e:  # the server went away
        return None, repr(e)


def swaps(server: ServeCommand) -> int:
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]["draft_update"]["swaps"]


def survive(fn, *args, **kwargs):
    """fn's answer, or the exception's repr when the server went away."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        return repr(e)


def answers(server: ServeCommand, prompt_ids: list[list[int]]) -> dict:
    """Greedy answers through the native and the OpenAI endpoints."""
    return {"generate": [o["output_ids"] for o in server.generate(prompt_ids, MAX_NEW)],
            "chat": server.chat(CHAT, MAX_NEW)["choices"][0]["message"]["content"]}


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module", params=["plain", "dspark"])
def fuzzed(request, smollm2_dir, prompt_ids, tmp_path_factory) -> dict:
    """One server of the kind: answers before, every bad request, answers after; stopped before the asserts."""
    from training.publish import push

    draft = build_bigram_draft(smollm2_dir, prompt_ids, tmp_path_factory.mktemp("draft") / "bigram")
    args = ["--no-draft"] if request.param == "plain" else ["--draft", str(draft)]
    root, outside = draft.parent, tmp_path_factory.mktemp("outside") / "bigram"  # a valid draft, out of the root
    shutil.copytree(draft, outside)
    (root / "escape").symlink_to(outside)
    escapes = {"symlink": str(root / "escape"), "dotdot": f"{root}/../{outside.parent.name}/bigram"}
    serve_args = [*args, "--admin-api-key", ADMIN_KEY, "--draft-root", str(root)]
    with ServeCommand(smollm2_dir, serve_args=serve_args) as s:
        before = answers(s, prompt_ids)
        bad = {what: send(s, path, body) for what, path, body, _ in BAD}
        streamed = send(s, GEN, STREAMED_BAD)
        admin = {"without key": survive(push, s.url, draft, timeout=120),
                 "calls": {path: (send(s, path, {}), send(s, path, {}, key=ADMIN_KEY)) for path in UPDATE_CALLS},
                 "outside root": {how: send(s, DISK, {"model_path": path}, key=ADMIN_KEY)
                                  for how, path in escapes.items()}}
        if request.param == "dspark":
            admin["swaps after refusals"] = survive(swaps, s)
        if request.param == "dspark":  # a draft folder is a draft update only where a draft is served
            admin["with key"] = survive(push, s.url, draft, timeout=120, key=ADMIN_KEY)
        after = survive(answers, s, prompt_ids)
        alive = s.proc.poll() is None
        log = s.log()
    return {"before": before, "bad": bad, "streamed": streamed, "admin": admin, "alive": alive, "after": after,
            "log": log, "kind": request.param}


def test_each_bad_request_gets_a_4xx_naming_the_problem(fuzzed):
    wrong = {what: fuzzed["bad"][what] for what, _, _, words in BAD
             if not (fuzzed["bad"][what][0] is not None and 400 <= fuzzed["bad"][what][0] < 500
                     and words in fuzzed["bad"][what][1])}
    assert not wrong, (wrong, fuzzed["log"][-3000:])
    status, events = fuzzed["streamed"]  # a stream has begun (200) when SGLang validates: the error is an event
    assert status == 200 and '"code":400' in events and "input_ids[1] = 1000000000 is out of range" in events, events


def test_draft_updates_need_the_admin_key_the_trainer_sends(fuzzed):
    """SGLang's --admin-api-key guards every draft-update call (disk, tensor, distributed) and /pause_generation;
    training.publish.push sends the key (the recipe's publish.admin_key_env). After both pushes the answers are still
    the same (next test)."""
    gate = {path: (without[0], with_key[0], "Field required" in with_key[1])
            for path, (without, with_key) in fuzzed["admin"]["calls"].items()}
    assert gate == {path: (401, 400, True) for path in UPDATE_CALLS}, fuzzed["admin"]["calls"]
    without, with_key = fuzzed["admin"]["without key"], fuzzed["admin"].get("with key")
    assert isinstance(without, dict) and without["status"] == 401 and not without["success"], without
    if fuzzed["kind"] == "dspark":
        assert isinstance(with_key, dict) and with_key["success"], with_key


def test_a_disk_update_outside_the_draft_root_is_refused_even_with_the_key(fuzzed):
    """`dspark serve --draft-root`: the path is resolved in the server (symlink, `..`) before it is judged."""
    refused = {how: (status, "outside the draft root" in message)
               for how, (status, message) in fuzzed["admin"]["outside root"].items()}
    assert refused == {"symlink": (400, True), "dotdot": (400, True)}, fuzzed["admin"]["outside root"]
    if fuzzed["kind"] == "dspark":
        assert fuzzed["admin"]["swaps after refusals"] == 0  # the old draft kept serving


def test_the_server_keeps_serving_the_same_answers(fuzzed):
    assert fuzzed["alive"], fuzzed["log"][-3000:]
    assert fuzzed["after"] == fuzzed["before"]
    assert all(len(o) == MAX_NEW for o in fuzzed["before"]["generate"])
