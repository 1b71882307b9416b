"""Bad input over HTTP: a seeded fuzz of a DSPARK server's OpenAI (/v1/completions, /v1/chat/completions) and native
(/generate) endpoints. Every case is a request no server should serve: malformed JSON, a body that is not a JSON
object, wrong types, huge max_tokens, negative or NaN sampling values, empty prompts, non-UTF-8 bytes, unknown fields,
an empty batch, top_k 0 or below -1, logprob fields that are not integers. Each must get a 4xx whose body carries a
message: never a 5xx, never a hang (no answer within --timeout). Afterwards the server must still answer greedy
requests exactly as before the fuzz.

    python benchmarks/http_fuzz.py [--cases 270] [--seed 0] [--draft DIR]

Without --draft the server runs an oracle bigram draft (dspark_testkit.build_bigram_draft; speed is not measured
here, only that the served path refuses what it must). Prints the count by status and writes
benchmarks/results/http_fuzz.json. The guard that answers these: dspark_sgl/sglang/guard.py. The soak test
(tests/test_sglang_soak.py) runs the same fuzz against its shared server.
"""

from __future__ import annotations

import json
import random
import sys
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from dspark_sgl.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "http_fuzz.json"
GEN, CMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
PROMPTS = ["1, 2, 3, 4, 5, 6,", "def fibonacci(n):"]
CHAT_PROMPT = "Name three colours."
MAX_NEW = 16


@dataclass
class Case:
    kind: str  # the family (malformed JSON, wrong type, ...)
    path: str
    data: bytes
    what: str  # the body or its description, for the report


def _ok_body(path: str, rng: random.Random, model: str) -> dict:
    """A good, cheap greedy request for `path`: each case breaks one thing in it."""
    text = rng.choice(["Hello", "The sky is", "1 + 1 ="])
    if path == GEN:
        return {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    if path == CMP:
        return {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0}
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}


def _set(path: str, body: dict, name: str, value) -> dict:
    """Set a sampling parameter where the endpoint takes it (inside sampling_params on /generate)."""
    if path == GEN:
        native = {"max_tokens": "max_new_tokens"}.get(name, name)
        return {**body, "sampling_params": {**body["sampling_params"], native: value}}
    return {**body, name: value}


def _prompt_field(path: str) -> str:
    return {GEN: "text", CMP: "prompt", CHAT: "messages"}[path]


BAD_SAMPLING = [  # (name, value): each refused by SGLang or by the guard
    ("temperature", -1.0), ("temperature", -0.01), ("temperature", "hot"), ("top_p", -0.5), ("top_p", 1.5),
    ("top_p", 0.0), ("min_p", -0.1), ("min_p", 1.5), ("frequency_penalty", -3.0), ("frequency_penalty", 9.0),
    ("presence_penalty", 3.0), ("repetition_penalty", -1.0), ("repetition_penalty", 0.0), ("max_tokens", -5),
    ("max_tokens", "many"), ("max_tokens", 2.5), ("top_k", 0), ("top_k", -2), ("top_k", -100), ("top_k", "all"),
    ("n", 0), ("n", -1), ("n", 10**9), ("stop", 5), ("temperature", [1.0]), ("min_tokens", -3),
]
HUGE = [10**7, 10**9, 10**12, 2**62, 2**63 - 1]
NAN_TEXT = ["NaN", "-Infinity", "Infinity"]  # not JSON: orjson refuses them as SGLang's parser
LOGPROB = {  # (name, value) per endpoint: logprob fields that are not integers
    GEN: [("top_logprobs_num", "3"), ("top_logprobs_num", 2.5), ("logprob_start_len", 1.5),
          ("logprob_start_len", "0"), ("token_ids_logprob", ["a"]), ("token_ids_logprob", [1.5]),
          ("top_logprobs_num", -1), ("top_logprobs_num", [1])],
    CMP: [("logprobs", "x"), ("logprobs", 2.5), ("logprobs", -1), ("logprobs", [1])],
    CHAT: [("top_logprobs", "x"), ("top_logprobs", 2.5), ("top_logprobs", -1), ("logprobs", "maybe")],
}
WRONG_PROMPT = {  # the prompt field with a wrong type
    GEN: [7, {"a": 1}, [1.5], [[1, "a"]], True, [None]],
    CMP: [7, {"a": 1}, [1.5], True, [None], [[1, 2], "x"]],
    CHAT: ["hi", 7, [{"role": "user"}], [{"content": "hi"}], [{"role": "wizard", "content": "hi"}], [[1]], [None],
           [{"role": "user", "content": 7}]],
}
# (chat: an empty message is a valid request, its template is not empty; no messages at all is the empty prompt)
EMPTY_PROMPT = {GEN: ["", [""]], CMP: ["", [""]], CHAT: [[]]}
EMPTY_BATCH = {GEN: [{"text": []}, {"input_ids": []}, {"input_ids": [[]]}, {"input_embeds": []}],
               CMP: [{"prompt": []}, {"prompt": [[]]}], CHAT: [{"messages": []}]}
UNKNOWN = ["temprature", "max_token", "topk", "sampling", "prompt_ids", "foo", "stream_option", "samplingparams"]
MALFORMED = [b"{", b"", b"{}}", b'{"text": "a",}', b"{'text': 'a'}", b'{"text": "a"', b"[1, 2", b"nul", b"\x00\x01",
             b'{"text": "a" "b"}', b"{text: 1}", b'"unterminated']


def fuzz_cases(model: str, seed: int = 0, n: int = 270) -> list[Case]:
    """`n` seeded cases, every family on every endpoint in turn (so any `n` covers all of them)."""
    rng = random.Random(seed)
    families = [_malformed, _not_object, _wrong_prompt, _bad_sampling, _huge_max, _nan, _empty_prompt, _non_utf8,
                _unknown_field, _empty_batch, _logprob]
    out = []
    while len(out) < n:
        family = families[len(out) % len(families)]
        path = (GEN, CMP, CHAT)[(len(out) // len(families)) % 3]
        kind, body = family(path, rng, model)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append(Case(kind, path, data, data[:200].decode(errors="backslashreplace")))
    return out


def _malformed(path, rng, model):
    return "malformed JSON", rng.choice(MALFORMED)


def _not_object(path, rng, model):
    return "JSON body not an object", rng.choice([[1, 2], [_ok_body(path, rng, model)], 7, -2.5, "hello", None, True])


def _wrong_prompt(path, rng, model):
    return "wrong type", {**_ok_body(path, rng, model), _prompt_field(path): rng.choice(WRONG_PROMPT[path])}


def _bad_sampling(path, rng, model):
    name, value = rng.choice(BAD_SAMPLING)
    return f"bad {name}", _set(path, _ok_body(path, rng, model), name, value)


def _huge_max(path, rng, model):
    return "huge max_tokens", _set(path, _ok_body(path, rng, model), "max_tokens", rng.choice(HUGE))


def _nan(path, rng, model):
    name = rng.choice(["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"])
    body = json.dumps(_set(path, _ok_body(path, rng, model), name, 12345.5))
    return "NaN sampling value", body.replace("12345.5", rng.choice(NAN_TEXT)).encode()


def _empty_prompt(path, rng, model):
    return "empty prompt", {**_ok_body(path, rng, model), _prompt_field(path): rng.choice(EMPTY_PROMPT[path])}


def _non_utf8(path, rng, model):
    body = json.dumps(_ok_body(path, rng, model), ensure_ascii=False).encode()
    junk = bytes([0xFF, *(rng.choice([0xFE, 0xC3, 0x80, 0xED]) for _ in range(rng.randint(0, 3)))])  # never UTF-8
    return "non-UTF-8 bytes", body.replace(b"Hello", junk).replace(b"The sky is", junk).replace(b"1 + 1 =", junk)


def _unknown_field(path, rng, model):
    return "unknown field", {**_ok_body(path, rng, model), rng.choice(UNKNOWN): rng.choice([0, "x", True, 1.5])}


def _empty_batch(path, rng, model):
    body = {k: v for k, v in _ok_body(path, rng, model).items() if k != _prompt_field(path)}
    return "empty batch", {**body, **rng.choice(EMPTY_BATCH[path])}


def _logprob(path, rng, model):
    name, value = rng.choice(LOGPROB[path])
    body = _ok_body(path, rng, model) | {name: value}
    if path == GEN:
        body["return_logprob"] = True
    elif path == CHAT and name != "logprobs":
        body["logprobs"] = True
    return "logprob field not an integer", body


def send_raw(url: str, case: Case, timeout: float) -> tuple[int | None, str]:
    """(HTTP status, the error message or the body); (None, why) when no answer came within `timeout`."""
    req = urllib.request.Request(url + case.path, data=case.data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")[:300]
    except urllib.error.HTTPError as e:
        return e.code, error_message(e.read().decode(errors="replace"))
    except Exception as e:  # a hang (timeout) or the server went away
        return None, repr(e)


def error_message(raw: str) -> str:
    """The message of an error body (SGLang's {"message"}, OpenAI's {"error": {"message"}}, FastAPI's {"detail"})."""
    try:
        err = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if isinstance(err, dict):
        err = err.get("error", err)
        if isinstance(err, dict):
            err = err.get("message") or err.get("detail") or ""
    return str(err)


def run_fuzz(url: str, model: str, seed: int = 0, n: int = 270, workers: int = 4, timeout: float = 60.0) -> list:
    """Send every case (`workers` at a time): [{case, status, message}] in case order."""
    cases = fuzz_cases(model, seed, n)
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda c: send_raw(url, c, timeout), cases))
    return [{"kind": c.kind, "path": c.path, "body": c.what, "status": s, "message": m}
            for c, (s, m) in zip(cases, answers, strict=True)]


def failures(results: list[dict]) -> list[dict]:
    """Cases without a 4xx carrying a message: a 2xx (served what it should refuse), a 5xx, or no answer."""
    return [r for r in results if not (r["status"] is not None and 400 <= r["status"] < 500 and r["message"].strip())]


def status_counts(results: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(str(r["status"]) for r in results).items()))


def greedy_answers(server: ServeCommand, prompt_ids: list[list[int]]) -> dict:
    """Greedy answers through the native and the OpenAI endpoints: must not change across the fuzz."""
    return {"generate": [o["output_ids"] for o in server.generate(prompt_ids, MAX_NEW)],
            "chat": server.chat(CHAT_PROMPT, MAX_NEW)["choices"][0]["message"]["content"]}


def main(
    cases: Annotated[int, typer.Option(help="how many seeded cases (>= 200)")] = 270,
    seed: int = 0,
    draft: Annotated[Path | None, typer.Option(help="a draft folder (default: an oracle bigram draft)")] = None,
    port: Annotated[int, typer.Option(help="the server's port (0: a free one)")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds a case may take before it counts as a hang")] = 60.0,
    out: Path = RESULT,
) -> None:
    import tempfile

    from transformers import AutoTokenizer

    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    target = smollm2_hf_dir()
    prompt_ids = [AutoTokenizer.from_pretrained(target)(p)["input_ids"] for p in PROMPTS]
    draft_name = str(draft) if draft else "bigram (oracle, built from the prompts)"
    with tempfile.TemporaryDirectory() as tmp:
        if draft is None:
            draft = build_bigram_draft(target, prompt_ids, Path(tmp) / "bigram")
        server = ServeCommand(target, serve_args=["--draft", str(draft)], **({"port": port} if port else {}))
        with server:
            model = server.get("/v1/models")["data"][0]["id"]
            before = greedy_answers(server, prompt_ids)
            results = run_fuzz(server.url, model, seed, cases, timeout=timeout)
            after = greedy_answers(server, prompt_ids)
            alive = server.proc.poll() is None
    bad = failures(results)
    counts = status_counts(results)
    by_kind = {k: status_counts([r for r in results if r["kind"] == k]) for k in sorted({r["kind"] for r in results})}
    print(f"{len(results)} cases: " + ", ".join(f"{n}x{s}" for s, n in counts.items())
          + f"; not a 4xx with a message: {len(bad)}; server alive: {alive}; greedy identical after: {after == before}")
    for kind, c in by_kind.items():
        print(f"  {kind:32s} " + ", ".join(f"{n}x{s}" for s, n in c.items()))
    for r in bad[:20]:
        print(f"  FAIL {r['status']} {r['path']} {r['kind']}: {r['body'][:120]} -> {r['message'][:160]}")
    record = provenance(cases=cases, seed=seed, draft=draft_name, timeout=timeout,
                        endpoints=[GEN, CMP, CHAT]) | {
        "counts": counts, "by_kind": by_kind, "failures": bad, "server_alive": alive,
        "greedy_identical_after": after == before, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    if bad or not alive or after != before:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
