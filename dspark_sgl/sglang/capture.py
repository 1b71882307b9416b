"""Hidden-state capture for training from a stock SGLang engine: aux layers + the post-norm last hidden state.

SGLang 0.5.23 already captures aux hidden states without a draft (`--enable-return-aux-hidden-states`, the DSPARK
capture convention, `--return-aux-hidden-state-layer-ids`): requests with `return_hidden_states=True` get the
concatenated outputs of those layers [T, K·H] (id i = OUTPUT of decoder layer i, as in HFTarget), and the logits
processor keeps the post-norm hidden of every token beside them (`LogitsProcessorOutput.last_hidden_states`) but
never returns it. The trainer needs both, so the one thing this module adds to SGLang is a hook that appends that
post-norm hidden to the returned rows when the model override `{"dspark_capture_last_hidden": true}` is set:

    rows = cat(aux_0 .. aux_{K-1}, last) [T, (K+1)·H]

Without the override key the hooks do nothing (plain serving and the DSPARK worker are unaffected). A capture server
runs with the radix cache and chunked prefill off: a cached prefix is not re-run, and of a chunked prompt only the
last chunk's rows are returned, so either would come back with fewer rows than tokens.
`server_args` / `engine_kwargs` spell the whole set; `capture` is the client (Engine object or http://host:port).
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

OVERRIDE_KEY = "dspark_capture_last_hidden"
logger = logging.getLogger(__name__)
CONVENTION = "dspark"  # SGLang's capture convention whose layer ids are layer OUTPUTS (tested against HFTarget)
FORWARD_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
INIT_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.__init__"
ROWS_TARGET = ("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
               "._append_prefill_hidden_states")


class CaptureError(ValueError):
    """A capture request or reply that does not describe one row per token of the asked width."""


# ---- server side: the hooks -----------------------------------------------------------------------------------
def capture_requested() -> bool:
    """True when this engine was started with the override key (read from SGLang's published server args)."""
    from dspark_sgl.sglang.args import override_arg

    return bool(override_arg(OVERRIDE_KEY, False))


def _init_after(_result, processor, *_args, **_kwargs) -> None:
    """AFTER LogitsProcessor.__init__: decide once per model whether to append, and refuse a half configuration
    at start-up (the scheduler process builds the model before serving anything)."""
    processor._dspark_capture = capture_requested()
    if not processor._dspark_capture:
        return
    from sglang.srt.runtime_context import get_exec

    convention = get_exec().features.aux_hidden_state_capture
    if convention != CONVENTION:
        raise ValueError(
            f"json-model-override-args {OVERRIDE_KEY!r} appends the post-norm hidden to aux captures, but this "
            f"server does not capture aux hidden states with the DSPARK convention (got {convention!r}); start it "
            f"with {' '.join(server_args(['<ids>']))}"
        )


def _forward_around(original, processor, *args, **kwargs):
    """AROUND LogitsProcessor.forward: under full capture, returned rows become cat(aux, post-norm last)."""
    out = original(processor, *args, **kwargs)
    if getattr(processor, "_dspark_capture", False) and out.hidden_states is not None:
        last = out.last_hidden_states
        if last is not None and last.shape[0] == out.hidden_states.shape[0]:
            out.hidden_states = torch.cat((out.hidden_states, last.to(out.hidden_states.dtype)), dim=-1)
    return out


def _rows_around(original, scheduler, *, req, logits_output, hidden_state_offset, capture_hidden_mode,
                 extend_input_len, store=True):
    """AROUND SchedulerBatchResultProcessor._append_prefill_hidden_states: a tagged capture request (its rid is a
    `transport.Route`) hands its rows, still one tensor, to the tensor data plane on the writer rank (attn-TP rank 0)
    and appends no lists; every other request goes through SGLang's own code."""
    from dspark_sgl.sglang.transport import parse_rid, writer

    route = parse_rid(getattr(req, "rid", None))
    if route is None or not capture_hidden_mode.is_full():
        return original(scheduler, req=req, logits_output=logits_output, hidden_state_offset=hidden_state_offset,
                        capture_hidden_mode=capture_hidden_mode, extend_input_len=extend_input_len, store=store)
    end = hidden_state_offset + extend_input_len
    if store and req.return_hidden_states and is_writer_rank():
        try:
            writer().deliver(route, logits_output.hidden_states[hidden_state_offset:end])
        except Exception as e:  # never take the scheduler down for one capture: the trainer re-sends the key
            logger.warning("dspark capture: rows of %s not delivered: %r", req.rid, e)
    return end


def is_writer_rank() -> bool:
    """Attention-TP rank 0 of its DP group: the one rank of a replica that ships rows (every TP rank holds them)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_rank == 0


def register_hooks() -> None:
    """Called from the plugin's load() in every SGLang process; the hooks only act in the scheduler's model."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_TARGET, _init_after, HookType.AFTER)
    HookRegistry.register(FORWARD_TARGET, _forward_around, HookType.AROUND)
    HookRegistry.register(ROWS_TARGET, _rows_around, HookType.AROUND)


# ---- the flags a capture server needs ---------------------------------------------------------------------------
def server_args(layer_ids: list) -> list[str]:
    """CLI flags for `sglang serve` / `python -m sglang.launch_server` that make it a capture server."""
    return [
        "--enable-return-aux-hidden-states", "--speculative-algorithm", "DSPARK",
        "--return-aux-hidden-state-layer-ids", *map(str, layer_ids),
        "--json-model-override-args", json.dumps({OVERRIDE_KEY: True}),
        "--disable-radix-cache", "--chunked-prefill-size", "-1",
    ]


def engine_kwargs(layer_ids: list[int]) -> dict[str, Any]:
    """The same settings as `sglang.Engine(**kwargs)` keyword arguments."""
    return dict(
        enable_return_aux_hidden_states=True, speculative_algorithm="DSPARK",
        return_aux_hidden_state_layer_ids=list(layer_ids),
        json_model_override_args=json.dumps({OVERRIDE_KEY: True}), disable_radix_cache=True,
        chunked_prefill_size=-1,
    )


# ---- client side ----------------------------------------------------------------------------------------------
@dataclass
class Captured:
    aux: Tensor  # [n, K·H] outputs of the capture layers, in layer-id order
    last: Tensor  # [n, H] post-final-norm hidden (what lm_head reads)


def _request(token_id_lists: list[list[int]]) -> dict[str, Any]:
    return {
        "input_ids": [list(map(int, ids)) for ids in token_id_lists],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
    }


def _post(url: str, payload: dict, timeout: float) -> list[dict]:
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return out if isinstance(out, list) else [out]


def prompt_rows(hidden_states: list) -> list:
    """meta_info["hidden_states"] holds one list of rows per prefill chunk, then one row per decode step: the
    prefill rows, flattened (decode rows are single rows of floats and are dropped)."""
    rows: list = []
    for entry in hidden_states:
        if entry and isinstance(entry[0], list):
            rows.extend(entry)
    return rows


def split_rows(rows: Any, n: int, num_aux: int, hidden_size: int) -> Captured:
    """One sample's returned rows [n, (K+1)·H] -> (aux [n, K·H], last [n, H]), or one CaptureError."""
    t = torch.as_tensor(rows, dtype=torch.float32)
    width = (num_aux + 1) * hidden_size
    if t.dim() != 2 or t.shape != (n, width):
        got = tuple(t.shape)
        hint = ""
        if t.dim() == 2 and t.shape[0] < n:
            hint = (" (fewer rows: cached prefixes and chunked prefill drop rows; start the server with "
                    "--disable-radix-cache --chunked-prefill-size -1)")
        elif t.dim() == 2 and t.shape[1] == num_aux * hidden_size:
            hint = f" (aux only: the server lacks --json-model-override-args '{{\"{OVERRIDE_KEY}\": true}}')"
        raise CaptureError(f"capture returned hidden states of shape {got} for a {n}-token sample, expected "
                           f"({n}, {width}) = (K+1)·H with K={num_aux} aux layers and H={hidden_size}{hint}")
    return Captured(t[:, : num_aux * hidden_size], t[:, num_aux * hidden_size :])


def capture(engine_or_url: Any, token_id_lists: list[list[int]], num_aux: int, hidden_size: int,
            timeout: float = 600.0) -> list[Captured]:
    """Prefill-only capture of every token of each sample, from an in-process `sglang.Engine` or an http URL."""
    outs = _send(engine_or_url, token_id_lists, {}, timeout)
    result = []
    for ids, out in zip(token_id_lists, outs, strict=True):
        hidden = out.get("meta_info", {}).get("hidden_states")
        if hidden is None:
            raise CaptureError("the server returned no hidden states: start it with the capture flags "
                               f"({' '.join(server_args(['<ids>']))})")
        result.append(split_rows(prompt_rows(hidden), len(ids), num_aux, hidden_size))
    return result


def _send(engine_or_url: Any, token_id_lists: list[list[int]], extra: dict, timeout: float) -> list[dict]:
    """One prefill-only request per sample (Engine object or http URL); one reply each."""
    if not token_id_lists or any(len(ids) == 0 for ids in token_id_lists):
        raise CaptureError("capture needs at least one sample and no empty sample")
    payload = {**_request(token_id_lists), **extra}
    if isinstance(engine_or_url, str):
        outs = _post(engine_or_url, payload, timeout)
    else:
        outs = engine_or_url.generate(**payload)
        outs = outs if isinstance(outs, list) else [outs]
    if len(outs) != len(token_id_lists):
        raise CaptureError(f"capture sent {len(token_id_lists)} samples and got {len(outs)} replies")
    return outs


def capture_to(engine_or_url: Any, token_id_lists: list[list[int]], rids: list[str], timeout: float = 600.0) -> None:
    """Prefill-only capture whose rows go to the tensor data plane: each sample's request id is the rid of its
    `transport.Route`; the engine's writer rank ships the rows there and the replies carry no hidden states."""
    if len(rids) != len(token_id_lists):
        raise CaptureError(f"{len(token_id_lists)} samples but {len(rids)} request ids")
    outs = _send(engine_or_url, token_id_lists, {"rid": list(rids)}, timeout)
    for rid, out in zip(rids, outs, strict=True):
        meta = out.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise CaptureError(f"the engine aborted capture request {rid}: {reason.get('message')}")
        if prompt_rows(meta.get("hidden_states") or []):
            raise CaptureError("a tagged capture came back as JSON lists: the engine does not run the dspark "
                               "plugin's row hook (SGLANG_PLUGINS must include 'dspark')")
