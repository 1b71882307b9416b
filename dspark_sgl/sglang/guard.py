"""One request never takes the server down: refuse what SGLang 0.5.23 passes unchecked to its scheduler.

SGLang validates most of a request in the HTTP process, but a few values reach the scheduler unchecked and raise
there, and an exception in the scheduler ends the whole server (seen on CPU; docs/serving.md says on which servers):

- a prompt token id outside [0, vocab): IndexError in the target's embedding;
- an empty prompt (`"text": ""`, or `[[]]` inside a batch; SGLang refuses only a single empty `input_ids`): a
  reshape error;
- `logprob_start_len` below -1 with `return_logprob`: an assertion in the logprob bookkeeping;
- `top_logprobs_num` above the vocabulary size with `return_logprob`: `topk` out of range;
- a `stop_token_ids` entry outside [0, vocab) with `min_new_tokens`: an index error in the min-tokens penalizer;
- `top_k` at or above 2**31: the batch's int32 top-k tensor overflows (found by a seeded fuzz);
- `return_hidden_states` that is neither a boolean nor "last" (e.g. `[]`): a ValueError in the scheduler's request
  constructor (found by a seeded fuzz).

Found by benchmarks/http_fuzz.py (a seeded fuzz of the HTTP endpoints), refused with a 400 instead of a 500 or
silence:
- a JSON body that is not an object (a list, number or string): `refuse_bad_body`, an AROUND hook on the HTTP
  server's JSON parse, names what came instead; it also refuses fields the endpoint does not know (SGLang ignores
  them silently, so a misspelt `max_token` or `temprature` changed nothing and got a 200);
- an empty batch (`"text": []`, `"input_embeds": []`): `refuse_empty_batch`, before SGLang sizes the batch;
- `top_k` 0 or below -1 (-1 is the whole vocabulary);
- logprob fields that are not integers (`top_logprobs_num`, `logprob_start_len`, `token_ids_logprob` entries).

Also refused: a `stop_regex` that is not a regular expression or a sampling_params list shorter than the batch
(SGLang answers both with a bare 500), and `n` outside [1, 128] (OpenAI's bound; SGLang has none: n = 8192 held a CPU
server busy past its health check, n = 10**9 got no answer in a minute and the server missed its health check).

`refuse_bad_request` is a BEFORE hook on `TokenizerManager._validate_one_request`: every generate and encode path
(native /generate single and batch, the OpenAI completions and chat endpoints, `n > 1`, batch tokenisation,
sglang.Engine) calls it once per request with the final prompt ids, just before the request is packed for the
scheduler, and a ValueError there is SGLang's own 400 path (its request state is released, the server keeps
serving). What must be refused before SGLang expands a request into one per prompt and sample (`n`, the length of a
sampling_params list) is checked by `refuse_bad_batch`, a BEFORE hook on the expansion step. Both are registered by
the `dspark` plugin, so every server `dspark serve` starts (plain, NGRAM, DSPARK) has them.
"""

from __future__ import annotations

import json
import re
from functools import cache

MAX_N = 128  # parallel samples per prompt: OpenAI's bound for `n`
MAX_TOP_K = 2**31 - 1  # SGLang batches top_k as int32


def _token_id_problem(name: str, ids, vocab_size: int) -> str | None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"{name}[{i}] = {t!r} is not an integer token id"
        if not 0 <= t < vocab_size:
            return f"{name}[{i}] = {t} is out of range: token ids must be in [0, {vocab_size})"
    return None


def _prompt_problem(obj, input_ids, vocab_size: int) -> str | None:
    if input_ids is None or getattr(obj, "contains_mm_input", lambda: False)():
        return None  # embeddings; or a multimodal prompt, which carries SGLang's own pad ids beyond the vocab
    if len(input_ids) == 0 and getattr(obj, "input_embeds", None) is None:
        session = getattr(obj, "session_params", None)
        if not (isinstance(session, dict) and session.get("id")):  # a session's history may be the whole prompt
            return "input_ids is empty: a request needs at least one prompt token"
    return _token_id_problem("input_ids", input_ids, vocab_size)


def _sampling_problem(params: dict, vocab_size: int) -> str | None:
    top_k = params.get("top_k")
    if _is_int(top_k):
        if top_k > MAX_TOP_K:
            return f"top_k = {top_k} is too large (at most {MAX_TOP_K}); -1 samples from the whole vocabulary"
        if top_k == 0 or top_k < -1:
            return f"top_k = {top_k} must be -1 (the whole vocabulary) or at least 1"
    stop = params.get("stop_token_ids")
    if stop is not None:
        if not isinstance(stop, list | tuple | set):
            return f"stop_token_ids must be a list of token ids, got {type(stop).__name__}"
        problem = _token_id_problem("stop_token_ids", list(stop), vocab_size)
        if problem:
            return problem
    regexes = params.get("stop_regex")
    for pattern in [regexes] if isinstance(regexes, str) else regexes or ():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            return f"stop_regex {pattern!r} is not a regular expression: {e}"
    return None


def _logprob_problem(obj, prompt_len: int, vocab_size: int) -> str | None:
    if not getattr(obj, "return_logprob", False):
        return None  # SGLang ignores both fields then
    start = getattr(obj, "logprob_start_len", -1)
    if start is not None and not (_is_int(start) and (start == -1 or 0 <= start <= prompt_len)):
        return (f"logprob_start_len = {start!r} must be -1 (no prompt logprobs) or in [0, {prompt_len}] "
                "(the prompt length)")
    top = getattr(obj, "top_logprobs_num", 0)
    if top is not None and not (_is_int(top) and 0 <= top <= vocab_size):
        return f"top_logprobs_num = {top!r} must be in [0, {vocab_size}] (the vocabulary size)"
    ids = getattr(obj, "token_ids_logprob", None)
    if ids is not None:
        if not isinstance(ids, list | tuple):
            return f"token_ids_logprob must be a list of token ids, got {type(ids).__name__}"
        return _token_id_problem("token_ids_logprob", ids, vocab_size)
    return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _hidden_states_problem(obj) -> str | None:
    mode = getattr(obj, "return_hidden_states", False)
    if mode is True or mode is False or (isinstance(mode, str) and mode == "last"):
        return None
    return f"return_hidden_states = {mode!r} must be true, false or \"last\" (one value per prompt)"


def request_problem(obj, input_ids, vocab_size: int) -> str | None:
    """What is wrong with one (already split) SGLang request whose prompt is `input_ids`, or None.

    `obj` is a GenerateReqInput or EmbeddingReqInput for one prompt; read by attribute so that a test can pass any
    object with the same fields.
    """
    params = getattr(obj, "sampling_params", None)
    return (_prompt_problem(obj, input_ids, vocab_size)
            or (_sampling_problem(params, vocab_size) if isinstance(params, dict) else None)
            or _logprob_problem(obj, len(input_ids) if input_ids is not None else 0, vocab_size)
            or _hidden_states_problem(obj))


def batch_problem(obj) -> str | None:
    """What is wrong with a whole GenerateReqInput before SGLang expands it into one request per prompt and sample
    (`n`), or None. Checked then because the expansion itself fails: n = 10**9 got no answer within a minute (SGLang
    builds one request id per sample), and a sampling_params list shorter than the batch raises IndexError (a 500)."""
    params = obj.sampling_params
    if isinstance(params, list) and not obj.is_single and len(params) != obj.batch_size:
        return (f"sampling_params has {len(params)} entries for {obj.batch_size} prompts: "
                "give one for all, or one per prompt")
    for p in params if isinstance(params, list) else [params]:
        n = p.get("n", 1) if isinstance(p, dict) else 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            return f"n = {n!r} must be an integer in [1, {MAX_N}] (parallel samples per prompt)"
    return None


def refuse_bad_batch(obj, *args, **kwargs):
    """BEFORE hook on GenerateReqInput._handle_parallel_sampling (in normalize_batch_and_arguments, the first thing
    TokenizerManager.generate_request does): SGLang's ValueError (HTTP 400) naming the problem."""
    problem = batch_problem(obj)
    if problem is not None:
        raise ValueError(problem)
    return None


def refuse_bad_request(tokenizer_manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request: SGLang's ValueError (HTTP 400) naming the problem."""
    problem = request_problem(obj, input_ids, int(tokenizer_manager.model_config.vocab_size))
    if problem is not None:
        raise ValueError(problem)
    return None


def empty_batch_problem(obj) -> str | None:
    """An empty batch (`"text": []`, `"input_embeds": []` or `[[]]`), or None. Checked before SGLang sizes the batch:
    it indexes the first embedding row (IndexError, a 500) and would send a batch of nothing to the scheduler.
    (An empty `input_ids` SGLang refuses itself.)"""
    for name in ("text", "input_embeds"):
        value = getattr(obj, name, None)
        if isinstance(value, list) and (not value or (name == "input_embeds" and not value[0])):
            return f"{name} is an empty batch: give at least one prompt"
    return None


def refuse_empty_batch(obj, *args, **kwargs):
    """BEFORE hook on GenerateReqInput._determine_batch_size: SGLang's ValueError (HTTP 400) naming the problem."""
    problem = empty_batch_problem(obj)
    if problem is not None:
        raise ValueError(problem)
    return None


def json_type(value) -> str:
    """JSON's name for the type of a parsed body: object, array, string, number, boolean or null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string"}.get(type(value), "number")


def body_problem(body, known: frozenset[str]) -> str | None:
    """What is wrong with a parsed JSON request body whose endpoint takes the fields `known`, or None."""
    if not isinstance(body, dict):
        return f"the request body must be a JSON object, got {json_type(body)}: {json.dumps(body)[:80]}"
    unknown = sorted(set(body) - known)
    if unknown:
        return (f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                "this endpoint does not take it (a misspelt parameter would otherwise be ignored)")
    return None


# The endpoints whose bodies refuse_bad_body checks, and the class that lists each one's fields.
GUARDED_BODIES = {
    "/generate": "sglang.srt.managers.io_struct.GenerateReqInput",
    "/v1/completions": "sglang.srt.entrypoints.openai.protocol.CompletionRequest",
    "/v1/chat/completions": "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest",
}


@cache
def known_fields(path: str) -> frozenset[str] | None:
    """The JSON fields the endpoint at `path` takes (a dataclass's fields, a pydantic model's fields and aliases), or
    None for an endpoint refuse_bad_body leaves alone."""
    import dataclasses
    import importlib

    target = GUARDED_BODIES.get(path)
    if target is None:
        return None
    module, name = target.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n)


async def refuse_bad_body(original, request, *args, **kwargs):
    """AROUND hook on the HTTP server's JSON parse (ORJSONRequest.json, which FastAPI calls before it validates the
    body): a 400 naming the problem. FastAPI passes an HTTPException raised there through unchanged."""
    body = await original(request, *args, **kwargs)
    known = known_fields(request.url.path)
    problem = body_problem(body, known) if known is not None else None
    if problem is not None:
        from fastapi import HTTPException

        raise HTTPException(status_code=400, detail=problem)
    return body
