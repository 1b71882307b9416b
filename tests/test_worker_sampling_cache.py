"""The worker's per-batch sampling cache must follow the requests, not their memory addresses."""

from __future__ import annotations

from types import SimpleNamespace

from dspark_sgl.sglang.sampling import BatchSamplingCache

FIELDS = dict(temperature=0.0, top_p=1.0, top_k=1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
              repetition_penalty=1.0, min_new_tokens=0, logit_bias=None, stop_token_ids=None, sampling_seed=None)


def req(rid: str, **params) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(**{**FIELDS, **params}), eos_token_ids={7},
                           tokenizer=None)


def test_a_new_request_at_a_freed_request_s_address_gets_its_own_parameters():
    """CPython reuses a freed object's address (hence its id()) for the next one: the next batch's requests can
    carry the previous batch's ids. Keyed on id(), the cache served the old batch's parameters to the new one."""
    cache = BatchSamplingCache(8, "cpu", "pytorch", deterministic=False)
    r = req("a")
    assert not cache.get([r]).any_penalty
    b = req("b", frequency_penalty=0.5)
    r.rid, r.sampling_params = b.rid, b.sampling_params  # same object (same id), now another request
    assert cache.get([r]).any_penalty
    assert cache.get([r]) is cache.get([r])  # unchanged batch: rebuilt only when the requests change
