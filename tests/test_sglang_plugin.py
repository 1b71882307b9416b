"""Fast checks of the SGLang plugin pieces: start-up validation, the slot-indexed draft context, the hooks.

The first two need no sglang; the hook test runs in the sglang venv (a subprocess, so HookRegistry's global state
never leaks into this process) and is skipped where that venv does not exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_sgl.config import ConfigError, DSparkConfig
from dspark_sgl.model.checkpoint import save_draft
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.sglang.args import refuse_parallelism
from dspark_sgl.sglang.checks import TargetFacts, check_draft
from dspark_sgl.sglang.context import DraftContextPool

sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
from dspark_testkit import build_random_draft, build_tiny_target, cpu_env, sglang_python  # noqa: E402

TARGET = TargetFacts(hidden_size=64, vocab_size=128, num_layers=6)


def tiny_config(**overrides) -> DSparkConfig:
    fields = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, vocab_size=128, block_size=4, target_layer_ids=[1, 3], mask_token_id=5,
                  markov_rank=8)
    fields.update(overrides)
    return DSparkConfig(**fields)


@pytest.fixture
def draft_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_draft(DSparkDraft(tiny_config()), tmp_path / "draft")


# ---- start-up checks --------------------------------------------------------------------------------------------
def test_good_draft_passes(draft_dir):
    assert check_draft(draft_dir, TARGET, block_size=4, num_draft_tokens=5).block_size == 4


@pytest.mark.parametrize(
    ("target", "kwargs", "message"),
    [
        (TargetFacts(96, 128, 6), {}, "hidden_size=64 != target hidden size 96"),
        (TargetFacts(64, 256, 6), {}, "vocab_size=128 != target vocab size 256"),
        (TARGET, {"block_size": 7}, "--speculative-dspark-block-size 7 does not match the draft's block_size 4"),
        (TARGET, {"num_draft_tokens": 8}, "must be block_size \\+ 1 = 5"),
        (TargetFacts(64, 128, 4), {}, "include the target's last layer"),
    ],
)
def test_mismatch_is_one_clear_error(draft_dir, target, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check_draft(draft_dir, target, **kwargs)


def test_missing_or_misshaped_weights_are_named(draft_dir):
    (draft_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        check_draft(draft_dir, TARGET)
    torch.manual_seed(0)
    save_draft(DSparkDraft(tiny_config(markov_rank=16)), draft_dir)  # weights of another rank...
    raw = json.loads((draft_dir / "config.json").read_text())
    raw["markov_rank"] = raw["dspark_config"]["markov_rank"] = raw["dflash_config"]["markov_rank"] = 8
    (draft_dir / "config.json").write_text(json.dumps(raw))  # ...under a config that says 8
    with pytest.raises(ConfigError, match="markov_head.markov_w1.weight: file \\(128, 16\\) vs config \\(128, 8\\)"):
        check_draft(draft_dir, TARGET)


# ---- parallel layouts: TP and DCP pass, PP / DP attention / DP replicas are refused, one message each ---------------
REFUSED = {
    "pp": ("--pp-size 2", "does not support pipeline parallelism \\(--pp-size 2\\)"),
    "attn_dp": ("--attn-dp-size 2 --tp-size 2", "does not support DP attention \\(--attn-dp-size 2"),
    "legacy_dp_attn": ("--dp-size 2 --enable-dp-attention --tp-size 2", "does not support DP attention"),
    "dp": ("--dp-size 2", "does not support data-parallel replicas \\(--dp-size 2\\)"),
}


def _view(**kw):
    return SimpleNamespace(**{"tp_size": 1, "dcp_size": 1, "pp_size": 1, "dp_size": 1, "attn_dp_size": 1,
                              "enable_dp_attention": False, **kw})


@pytest.mark.parametrize(("fields", "case"), [({"pp_size": 2}, "pp"), ({"attn_dp_size": 2, "tp_size": 2}, "attn_dp"),
                                              ({"dp_size": 2}, "dp")])
def test_unsupported_parallelism_is_one_clear_error(fields, case):
    with pytest.raises(ValueError, match=REFUSED[case][1]):
        refuse_parallelism(_view(**fields))


def test_tp_and_dcp_pass():
    refuse_parallelism(_view(tp_size=8, dcp_size=8))
    refuse_parallelism(_view(pp_size=None, dp_size=None, attn_dp_size=None))  # unset fields


RESOLVE_PROBE = """
import sys
import sglang.srt.plugins as plugins
from dspark_sgl.sglang import plugin
plugin.load()
plugins.HookRegistry.apply_hooks()
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.server_args import prepare_server_args
target, draft = sys.argv[1:3]
base = ["--model-path", target, "--device", "cpu", "--attention-backend", "torch_native", "--speculative-algorithm",
        "DSPARK", "--speculative-draft-model-path", draft]
for extra in sys.argv[3:]:
    args = prepare_server_args(base + extra.split())
    try:
        args.resolve_once()  # SGLang's whole resolution pipeline, our handler inside it; nothing is launched
        print(f"{extra!r}: resolved, overlap {'off' if resolution_result(args, 'disable_overlap_schedule') else 'on'}")
    except ValueError as e:
        print(f"{extra!r}: refused: {e}")
"""


@pytest.mark.sglang
def test_sglang_resolution_refuses_pp_and_dp_attention_and_overlap_on_cpu(tmp_path):
    """Through SGLang's own argument resolution (each flag spelling as an operator types it): the deprecated
    `--dp-size N --enable-dp-attention` reaches our handler as `--attn-dp-size N`, and is refused as such. And a CPU
    server resolves without the overlap scheduler, as SGLang's own handlers do for speculative decoding there."""
    target = build_tiny_target(tmp_path / "target", vocab=16)
    draft = build_random_draft(target, tmp_path / "draft", block_size=3, target_layer_ids=[0, 1])
    flags = ["--tp-size 2", *(f for f, _ in REFUSED.values())]
    res = subprocess.run([str(sglang_python()), "-c", RESOLVE_PROBE, str(target), str(draft), *flags],
                         capture_output=True, text=True, env=cpu_env(), cwd="/tmp", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # resolved, and as SGLang resolves speculative decoding on a CPU: no overlap scheduler (it delays every first token
    # by a step)
    assert "'--tp-size 2': resolved, overlap off" in res.stdout, res.stdout
    for flag, message in REFUSED.values():
        assert re.search(f"'{flag}': refused: dspark-sgl DSPARK {message}", res.stdout), (flag, res.stdout)


# ---- the slot-indexed draft context ------------------------------------------------------------------------------
@pytest.mark.parametrize("anchor_state", [False, True])
def test_pool_context_matches_the_reference_cache(anchor_state):
    """Scattered slots + gather must give the draft exactly the context DraftContextCache gives it (with
    `anchor_state`, also the context vector of each request's last committed token)."""
    torch.manual_seed(0)
    c = tiny_config(anchor_state=anchor_state)
    draft = DSparkDraft(c).eval()
    if anchor_state:
        with torch.no_grad():
            draft.anchor_proj.weight.normal_(0, 0.3)  # zero at init: make the path count
    draft.bind_target(torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size))
    lengths = torch.tensor([5, 9])
    aux = torch.randn(2, 9, c.num_aux * c.hidden_size)
    ref = DraftContextCache(draft, 2, "cpu", torch.float32)
    ref.append(aux, lengths)

    pool = DraftContextPool(draft, num_slots=64, device="cpu", dtype=torch.float32)
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    slots = torch.randperm(63)[:18] + 1  # distinct slots, request rows in no particular order
    req_to_token[2, :9], req_to_token[0, :9] = slots[:9], slots[9:]
    req_pool_indices = torch.tensor([2, 0])
    for b, row in enumerate(req_pool_indices.tolist()):
        n = int(lengths[b])
        pool.write(req_to_token[row, :n], aux[b, :n], torch.arange(n))
    ctx = pool.gather(req_to_token, req_pool_indices, lengths)

    anchor = torch.tensor([7, 11])
    torch.testing.assert_close(draft.forward_step(anchor, ctx), draft.forward_step(anchor, ref))


# ---- hooks in real SGLang ----------------------------------------------------------------------------------------
HOOK_PROBE = """
import sglang.srt.plugins as plugins
from dspark_sgl.sglang import plugin
plugin.load()
plugins.HookRegistry.apply_hooks()
from sglang.srt.speculative.dspark_components import dspark_worker_v2
from sglang.srt.arg_groups import speculative_hook
from dspark_sgl.sglang.args import handle_dspark_args
print("worker:", dspark_worker_v2.DSparkWorkerV2.__module__)
print("patched:", sorted(t for t in plugins.HookRegistry._patched if "speculative" in t))
print("args hook:", [h is handle_dspark_args for _, h, _ in plugins.HookRegistry._hooks[plugin.ARGS_TARGET]])
try:
    speculative_hook._handle_dspark(object())
except Exception as e:
    print("handler raised:", type(e).__name__)
"""


@pytest.mark.sglang
def test_plugin_takes_over_the_builtin_dspark_name():
    py = sglang_python()
    res = subprocess.run([str(py), "-c", HOOK_PROBE], capture_output=True, text=True, env=cpu_env(), cwd="/tmp",
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "worker: dspark_sgl.sglang.worker" in res.stdout
    for target in ("_handle_dspark", "DSparkWorkerV2", "handle_speculative_decoding"):
        assert target in res.stdout  # all three hooks applied
    assert "args hook: [True]" in res.stdout
    assert "replaces SGLang's builtin DSPARK worker" in res.stderr


GUARD_PROBE = """
import types
import sglang.srt.plugins as plugins
from dspark_sgl.sglang import plugin
plugin.load()
plugins.HookRegistry.apply_hooks()
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
for algo in ("NGRAM", "EAGLE", "DSPARK", None):
    tm = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=100),
                               server_args=types.SimpleNamespace(speculative_algorithm=algo))
    obj = GenerateReqInput(input_ids=[5, 100], sampling_params={"max_new_tokens": 1})
    obj.normalize_batch_and_arguments()
    try:
        TokenizerManager._validate_one_request(tm, obj, obj.input_ids)
        print(algo, "passed")
    except ValueError as e:
        print(algo, "refused:", e)
try:  # the whole request, before SGLang expands it into one request per sample
    GenerateReqInput(input_ids=[5], sampling_params={"n": 129}).normalize_batch_and_arguments()
except ValueError as e:
    print("expansion refused:", e)
try:  # an empty batch, before SGLang sizes it
    GenerateReqInput(text=[], sampling_params={}).normalize_batch_and_arguments()
except ValueError as e:
    print("empty batch refused:", e)
from dspark_sgl.sglang.guard import GUARDED_BODIES, known_fields
print("fields:", sorted(p for p in GUARDED_BODIES if "stream" in known_fields(p) and len(known_fields(p)) > 20))
print("body hook:", plugin.BODY_TARGET in plugins.HookRegistry._patched)
"""


@pytest.mark.sglang
def test_the_request_guard_covers_every_speculative_algorithm():
    """The guard is one hook on SGLang's per-request validation, whatever the server runs: an out-of-vocabulary
    prompt is refused on an NGRAM (or EAGLE, or plain) server as on a DSPARK one, before it reaches the scheduler.
    Over HTTP for plain and DSPARK: tests/test_sglang_guard.py."""
    res = subprocess.run([str(sglang_python()), "-c", GUARD_PROBE], capture_output=True, text=True, env=cpu_env(),
                         cwd="/tmp", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for algo in ("NGRAM", "EAGLE", "DSPARK", "None"):
        assert f"{algo} refused: input_ids[1] = 100 is out of range: token ids must be in [0, 100)" in res.stdout, \
            res.stdout
    assert "expansion refused: n = 129 must be an integer in [1, 128]" in res.stdout, res.stdout
    assert "empty batch refused: text is an empty batch" in res.stdout, res.stdout
    # the JSON-body check (non-object bodies, unknown fields) knows each guarded endpoint's fields, hooked in place
    assert "fields: ['/generate', '/v1/chat/completions', '/v1/completions']" in res.stdout, res.stdout
    assert "body hook: True" in res.stdout, res.stdout
