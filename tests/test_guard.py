"""The request guard of every served SGLang (dspark_sgl.sglang.guard), without SGLang: what it refuses and what it
lets through. Over HTTP against real servers: tests/test_sglang_guard.py."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from dspark_sgl.sglang import guard
from dspark_sgl.sglang.guard import (
    batch_problem,
    body_problem,
    empty_batch_problem,
    refuse_bad_batch,
    refuse_bad_body,
    refuse_bad_request,
    refuse_empty_batch,
    request_problem,
)

V = 100


def req(**fields) -> SimpleNamespace:
    """One split GenerateReqInput as SGLang hands it to _validate_one_request (its defaults after normalize)."""
    base = dict(input_embeds=None, session_params=None, sampling_params={"max_new_tokens": 4}, return_logprob=False,
                logprob_start_len=-1, top_logprobs_num=0, return_hidden_states=False, contains_mm_input=lambda: False)
    return SimpleNamespace(**(base | fields))


@pytest.mark.parametrize(
    ("ids", "fields", "message"),
    [
        ([1_000_000_000, -1], {}, r"input_ids\[0\] = 1000000000 is out of range: token ids must be in \[0, 100\)"),
        ([3, -1], {}, r"input_ids\[1\] = -1 is out of range"),
        ([3, V], {}, r"input_ids\[1\] = 100 is out of range"),
        ([3, True], {}, r"input_ids\[1\] = True is not an integer token id"),
        ([2.0], {}, r"input_ids\[0\] = 2.0 is not an integer token id"),
        ([], {}, "input_ids is empty"),
        ([1], dict(sampling_params={"stop_token_ids": [5, V], "min_new_tokens": 2}), r"stop_token_ids\[1\] = 100"),
        ([1], dict(sampling_params={"stop_token_ids": [-5]}), r"stop_token_ids\[0\] = -5 is out of range"),
        ([1], dict(sampling_params={"stop_token_ids": 5}), "stop_token_ids must be a list of token ids, got int"),
        ([1], dict(sampling_params={"top_k": 2**31}), r"top_k = 2147483648 is too large \(at most 2147483647\)"),
        ([1], dict(sampling_params={"stop_regex": "("}), r"stop_regex '\(' is not a regular expression: missing \)"),
        ([1], dict(sampling_params={"stop_regex": ["a+", "[z"]}), r"stop_regex '\[z' is not a regular expression"),
        ([1, 2], dict(return_logprob=True, logprob_start_len=-7), r"logprob_start_len = -7 must be -1 .* \[0, 2\]"),
        ([1, 2], dict(return_logprob=True, logprob_start_len=3), r"logprob_start_len = 3 must be"),
        ([1], dict(return_logprob=True, top_logprobs_num=V + 1), r"top_logprobs_num = 101 must be in \[0, 100\]"),
        ([1], dict(return_logprob=True, top_logprobs_num=-3), r"top_logprobs_num = -3 must be in \[0, 100\]"),
        ([1], dict(return_logprob=True, logprob_start_len="x"), r"logprob_start_len = 'x' must be"),
        ([1], dict(return_logprob=True, top_logprobs_num=[]), r"top_logprobs_num = \[\] must be"),
        ([1], dict(return_hidden_states=[]), r"return_hidden_states = \[\] must be true, false or \"last\""),
        ([1], dict(return_hidden_states="first"), r"return_hidden_states = 'first' must be"),
        ([1], dict(return_hidden_states=1), r"return_hidden_states = 1 must be"),
        # found by benchmarks/http_fuzz.py
        ([1], dict(sampling_params={"top_k": 0}), r"top_k = 0 must be -1 \(the whole vocabulary\) or at least 1"),
        ([1], dict(sampling_params={"top_k": -2}), r"top_k = -2 must be -1"),
        ([1], dict(return_logprob=True, top_logprobs_num=2.5), r"top_logprobs_num = 2.5 must be"),
        ([1], dict(return_logprob=True, top_logprobs_num=True), r"top_logprobs_num = True must be"),
        ([1, 2], dict(return_logprob=True, logprob_start_len=0.0), r"logprob_start_len = 0.0 must be"),
        ([1], dict(return_logprob=True, token_ids_logprob=[3, "a"]), r"token_ids_logprob\[1\] = 'a' is not an integer"),
        ([1], dict(return_logprob=True, token_ids_logprob=[V]), r"token_ids_logprob\[0\] = 100 is out of range"),
        ([1], dict(return_logprob=True, token_ids_logprob=7), "token_ids_logprob must be a list of token ids, got int"),
    ],
)
def test_each_problem_is_named(ids, fields, message):
    obj = req(**fields)
    assert request_problem(obj, ids, V) is not None
    tm = SimpleNamespace(model_config=SimpleNamespace(vocab_size=V))
    with pytest.raises(ValueError, match=message):  # SGLang turns this ValueError into an HTTP 400
        refuse_bad_request(tm, obj, ids)


@pytest.mark.parametrize(
    ("ids", "fields"),
    [
        ([0, V - 1], {}),  # both ends of the vocabulary
        ([1], dict(sampling_params={"stop_token_ids": [0, V - 1], "min_new_tokens": 2})),
        ([1], dict(sampling_params={"stop_token_ids": None, "stop_regex": None})),
        ([1], dict(sampling_params={"stop_regex": ["\\d+\\.", "end$"]})),
        ([1], dict(sampling_params={"top_k": 2**31 - 1})),
        ([1], dict(sampling_params={"top_k": -1})),
        ([1], dict(sampling_params={"top_k": 1})),
        ([1], dict(return_logprob=True, token_ids_logprob=[0, V - 1])),
        ([1, 2], dict(return_logprob=True, logprob_start_len=-1, top_logprobs_num=V)),
        ([1, 2], dict(return_logprob=True, logprob_start_len=2, top_logprobs_num=0)),
        ([1, 2], dict(logprob_start_len=-7, top_logprobs_num=-3)),  # ignored without return_logprob (as SGLang does)
        ([1], dict(return_hidden_states=True)),
        ([1], dict(return_hidden_states="last")),
        ([], dict(session_params={"id": "s1"})),  # a session's history may be the whole prompt
        ([], dict(input_embeds=[[0.0, 1.0]])),  # prompt given as embeddings
        ([10**9], dict(contains_mm_input=lambda: True)),  # multimodal pad ids lie beyond the vocabulary on purpose
        (None, {}),
    ],
)
def test_good_requests_pass(ids, fields):
    assert request_problem(req(**fields), ids, V) is None


def test_an_embedding_request_without_generation_fields_is_checked_too():
    obj = SimpleNamespace(input_embeds=None, session_params=None, sampling_params=None,
                          contains_mm_input=lambda: False)  # EmbeddingReqInput has no logprob fields
    assert request_problem(obj, [1, 2], V) is None
    assert "input_ids[0] = 100" in request_problem(obj, [V], V)


def batch(params, batch_size=1, is_single=True) -> SimpleNamespace:
    """A GenerateReqInput as SGLang hands it to _handle_parallel_sampling (batch size known, not yet expanded)."""
    return SimpleNamespace(sampling_params=params, batch_size=batch_size, is_single=is_single)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (batch({"n": 129}), r"n = 129 must be an integer in \[1, 128\]"),
        (batch({"n": 10**9}), r"n = 1000000000 must be"),
        (batch({"n": 0}), r"n = 0 must be"),
        (batch({"n": -2}, 2, False), r"n = -2 must be"),
        (batch({"n": 2.5}), r"n = 2.5 must be"),
        (batch([{"n": 2}, {"n": 200}], 2, False), r"n = 200 must be"),
        (batch([{}], 2, False), r"sampling_params has 1 entries for 2 prompts"),
    ],
)
def test_each_batch_problem_is_named(obj, message):
    with pytest.raises(ValueError, match=message):
        refuse_bad_batch(obj)


@pytest.mark.parametrize(
    "obj",
    [batch(None), batch({}), batch({"n": 1}), batch({"n": 128}), batch([{"n": 3}, {"n": 3}], 2, False),
     batch({"n": 4}, 3, False)],
)
def test_good_batches_pass(obj):
    assert batch_problem(obj) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(text=[]), "text is an empty batch: give at least one prompt"),
        (dict(input_embeds=[]), "input_embeds is an empty batch"),
        (dict(input_embeds=[[]]), "input_embeds is an empty batch"),
    ],
)
def test_an_empty_batch_is_refused(fields, message):
    obj = SimpleNamespace(**({"text": None, "input_ids": None, "input_embeds": None} | fields))
    with pytest.raises(ValueError, match=message):
        refuse_empty_batch(obj)


@pytest.mark.parametrize("fields", [dict(text="hi"), dict(text=["hi", ""]), dict(input_ids=[[1]]),
                                    dict(input_embeds=[[0.0, 1.0]])])
def test_a_batch_with_prompts_passes(fields):
    assert empty_batch_problem(SimpleNamespace(**({"text": None, "input_ids": None, "input_embeds": None} | fields))) \
        is None


KNOWN = frozenset({"text", "sampling_params"})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], r"the request body must be a JSON object, got array: \[1, 2\]"),
        (7, "must be a JSON object, got number: 7"),
        (2.5, "got number"),
        ("hi", 'got string: "hi"'),
        (None, "got null"),
        (True, "got boolean"),
        ({"text": "a", "temprature": 0}, r"unknown field 'temprature': this endpoint does not take it"),
        ({"b": 1, "a": 2}, r"unknown fields 'a', 'b'"),
    ],
)
def test_a_bad_body_is_named(body, message, fake_fastapi):
    assert body_problem(body, KNOWN) is not None
    with pytest.raises(fake_fastapi, match=message) as info:  # FastAPI answers its HTTPException with this status
        asyncio.run(refuse_bad_body(_parsed(body), _request("/generate")))
    assert info.value.status_code == 400


@pytest.fixture
def fake_fastapi(monkeypatch):
    """FastAPI's HTTPException (FastAPI lives in the SGLang venv, not this one), and /generate's fields."""

    class HTTPException(Exception):
        def __init__(self, status_code: int, detail: str):
            super().__init__(detail)
            self.status_code = status_code

    monkeypatch.setitem(sys.modules, "fastapi", SimpleNamespace(HTTPException=HTTPException))
    monkeypatch.setitem(guard.GUARDED_BODIES, "/generate", "test_guard_fields.Body")
    monkeypatch.setitem(sys.modules, "test_guard_fields", SimpleNamespace(Body=Body))
    guard.known_fields.cache_clear()
    yield HTTPException
    guard.known_fields.cache_clear()


@dataclass
class Body:
    text: str
    sampling_params: dict


def test_a_good_body_passes_and_other_endpoints_are_left_alone(fake_fastapi):
    body = {"text": "a", "sampling_params": {"anything": 1}}  # nested fields are SGLang's own check
    assert body_problem(body, KNOWN) is None
    assert asyncio.run(refuse_bad_body(_parsed(body), _request("/generate"))) is body
    assert asyncio.run(refuse_bad_body(_parsed([1]), _request("/update_weights_from_disk"))) == [1]


def _parsed(body):
    async def original(request):
        return body

    return original


def _request(path: str) -> SimpleNamespace:
    return SimpleNamespace(url=SimpleNamespace(path=path))
