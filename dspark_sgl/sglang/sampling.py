"""SGLang requests -> the shared per-request target distribution (dspark_sgl.speculative.target_dist), the output
history that penalties read, and the per-request refusals. SGLang plumbing only; the math lives in speculative/.

History. SGLang's penalizer state cannot serve verify: the forward copy of the batch drops the orchestrator, and
speculative decoding feeds it one token per step. So the worker records the token id at every KV slot it commits
(prefill: the extended tokens; verify: the anchor and the accepted drafts), as it does the draft context, and reads a
request's output so far from its slots through req_to_token (exact under overlap scheduling and radix-cache hits:
a shared slot holds the same token).

Refused per request (SGLang's own HTTP 400 path: a ValueError while the tokenizer manager validates the request;
the server keeps serving): a custom logit processor (it reads the request's history, which SGLang gives it without
the block's draft tokens, so verify cannot reproduce what plain decoding would sample) and return_sampling_mask
(the worker does not build the sampler's mask output).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_sgl.speculative.target_dist import BatchSampling, OutputHistory, RequestSampling

DETERMINISTIC_DEFAULT_SEED = 42  # SGLang's seed for rows without sampling_seed under deterministic inference
REFUSED = {
    "custom_logit_processor": "dspark-sgl DSPARK does not support custom_logit_processor: a processor sees the "
    "request's history without the draft block's tokens, so verify cannot reproduce plain sampling; send this "
    "request to a server without speculative decoding",
    "return_sampling_mask": "dspark-sgl DSPARK does not support return_sampling_mask: the speculative worker does "
    "not build the sampler's mask output; send this request to a server without speculative decoding",
}


def refused_parameter(obj) -> str | None:
    """The first parameter of a GenerateReqInput (one request) that DSPARK refuses, or None."""
    for name in REFUSED:
        value = getattr(obj, name, None)
        if value if not isinstance(value, list) else any(value):
            return name
    return None


def refuse_unsupported_request(tokenizer_manager, obj, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request: raise SGLang's ValueError (HTTP 400) naming the
    parameter, on DSPARK servers only."""
    algo = str(getattr(tokenizer_manager.server_args, "speculative_algorithm", None) or "").upper()
    if algo == "DSPARK":
        name = refused_parameter(obj)
        if name is not None:
            raise ValueError(REFUSED[name])
    return None


def request_sampling(req, deterministic: bool) -> RequestSampling:
    """One SGLang Req's sampling parameters (SGLang stores greedy as top_k = 1)."""
    sp = req.sampling_params
    stop = set(sp.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        stop |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            stop.add(tok.eos_token_id)
    seed = sp.sampling_seed
    if seed is None and deterministic:
        seed = DETERMINISTIC_DEFAULT_SEED
    return RequestSampling(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        min_new_tokens=sp.min_new_tokens,
        logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()} if sp.logit_bias else None,
        stop_token_ids=frozenset(int(t) for t in stop if t is not None),
        sampling_seed=seed,
    )


class BatchSamplingCache:
    """BatchSampling of the scheduler's current requests, rebuilt only when the set of requests changes."""

    def __init__(self, vocab_size: int, device, backend: str, deterministic: bool):
        self.vocab_size, self.device, self.backend, self.deterministic = vocab_size, device, backend, deterministic
        self._key: tuple | None = None
        self._value: BatchSampling | None = None

    def get(self, reqs) -> BatchSampling:
        key = tuple(r.rid for r in reqs)  # not id(): a new Req can take a freed one's address
        if key != self._key:
            rows = [request_sampling(r, self.deterministic) for r in reqs]
            # torch Sampler: joint top-k/top-p/min-p; FlashInfer: joint top-k/top-p, sequential once min-p is on
            joint = self.backend == "pytorch" or not any(r.min_p > 0 for r in rows)
            self._key, self._value = key, BatchSampling.from_requests(rows, self.vocab_size, self.device, joint)
        return self._value


class SlotTokens:
    """The token id committed at each KV slot of SGLang's pool."""

    def __init__(self, num_slots: int, device):
        self.ids = torch.zeros(num_slots, dtype=torch.int32, device=device)

    def write(self, slots: Tensor, tokens: Tensor, keep: Tensor | None = None) -> None:
        """keep [N] bool: write only those (the rest go to SGLang's padding slot 0; a fixed-shape write)."""
        if keep is not None:
            slots = torch.where(keep, slots, 0)
        self.ids[slots.long()] = tokens.to(torch.int32)

    def history(self, req_to_token: Tensor, req_pool_indices: Tensor, prompt_lens: Tensor, seq_lens: Tensor,
                max_output_len: int, anchor: Tensor, vocab_size: int) -> OutputHistory:
        """Each request's output so far: slots prompt_len .. seq_len-1, then the anchor (its KV comes at verify).
        max_output_len >= every seq_len - prompt_len, from host-side state (no device read)."""
        L = max(max_output_len, 0) + 1
        pos = prompt_lens[:, None] + torch.arange(L - 1, device=seq_lens.device)[None]  # [B, L-1]
        valid = pos < seq_lens[:, None]
        slots = req_to_token[req_pool_indices.long()[:, None], pos.clamp(max=req_to_token.shape[1] - 1)]
        tokens = torch.where(valid, self.ids[slots.long()].long(), 0)
        tokens = torch.cat((tokens, anchor[:, None].long()), 1)
        valid = torch.cat((valid, torch.ones(valid.shape[0], 1, dtype=torch.bool, device=valid.device)), 1)
        return OutputHistory.from_tokens(tokens, valid, vocab_size)
