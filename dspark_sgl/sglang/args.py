"""Our `_handle_dspark`: validate the draft against the target, then pin the server args DSPARK needs.

Replaces SGLang's handler (which refuses CPU and knows nothing of our checks). Runs in the launcher while SGLang
resolves server args, so a bad draft stops start-up with one ConfigError before any process is spawned.
"""

from __future__ import annotations

import logging

from dspark_sgl.sglang.checks import TargetFacts, check_draft

logger = logging.getLogger(__name__)
SOURCE = "dspark_sgl.handle_dspark_args"
SUPPORTED_DEVICES = ("cuda", "cpu")


def override_arg(key: str, default=None):
    """One of our keys in the server's --json-model-override-args (how `dspark serve` and operators pass settings
    that SGLang has no flag for), read from SGLang's published server args in whichever process asks."""
    import json

    from sglang.srt.runtime_context import get_model

    return json.loads(get_model().json_model_override_args or "{}").get(key, default)


def refuse_parallelism(cfg) -> None:
    """One ValueError per layout the worker cannot serve; TP and DCP pass. `cfg` is SGLang's resolving view, read
    after SGLang has turned the deprecated `--dp-size N --enable-dp-attention` into `--attn-dp-size N`."""
    pp, attn_dp, dp = (getattr(cfg, k, 1) or 1 for k in ("pp_size", "attn_dp_size", "dp_size"))
    if pp > 1:
        raise ValueError(
            f"dspark-sgl DSPARK does not support pipeline parallelism (--pp-size {pp}): the draft reads hidden states "
            "captured across the whole target and verifies on its logits in one step, and the worker has no path "
            "for SGLang's stage-to-stage proxy tensors. Drop --pp-size and use --tp-size.")
    if attn_dp > 1 or getattr(cfg, "enable_dp_attention", False):
        raise ValueError(
            f"dspark-sgl DSPARK does not support DP attention (--attn-dp-size {attn_dp}, or --dp-size N "
            "--enable-dp-attention): each attention-DP group schedules its own batch, so the worker would have to "
            "draft per group and join the MoE collectives of idle groups, which it does not. Drop DP attention, or "
            "serve with SGLang's builtin DSPARK (SGLANG_PLUGINS=none).")
    if dp > 1:
        raise ValueError(
            f"dspark-sgl DSPARK does not support data-parallel replicas (--dp-size {dp}) yet (untested with this "
            f"worker): start {dp} servers, one per replica, behind a router instead.")


def handle_dspark_args(server_args) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.arg_groups.speculative_hook import _disable_overlap_schedule_for_cpu

    cfg = resolving_view(server_args)
    device = str(cfg.device or "cuda")
    if not device.startswith(SUPPORTED_DEVICES):
        raise ValueError(f"dspark-sgl DSPARK runs on {SUPPORTED_DEVICES}, not device={device!r}")
    if cfg.speculative_draft_model_path is None:
        raise ValueError("DSPARK needs --speculative-draft-model-path (a dspark-sgl or SGLang DSpark draft folder)")
    refuse_parallelism(cfg)
    # SGLang's own rule for its speculative algorithms on a CPU (EAGLE family, NGRAM), which the builtin handler we
    # replace skipped: no device stream to overlap with, so the overlap scheduler only handles each step's result
    # after the next step has run, and every first token waits a whole decode step (docs/serving.md, "Overlap
    # scheduler: off for DSPARK on a CPU").
    _disable_overlap_schedule_for_cpu(server_args)
    draft = check_draft(
        cfg.speculative_draft_model_path,
        TargetFacts.from_path(cfg.model_path),
        block_size=cfg.speculative_dspark_block_size,
        num_draft_tokens=cfg.speculative_num_draft_tokens,
    )
    declare_resolution(
        server_args,
        SOURCE,
        speculative_num_steps=1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=draft.block_size + 1,
    )
    if cfg.max_running_requests is None:
        # SGLang's own default for every speculative algorithm (speculative_hook.py: _handle_dspark, _handle_dflash,
        # _handle_eagle_family, _handle_ngram, _handle_frozen_kv_mtp all resolve 48), so DSPARK matches the builtin
        declare_resolution(server_args, SOURCE, max_running_requests=48)
        logger.info("dspark-sgl DSPARK: max_running_requests 48 (SGLang's default for speculative decoding; "
                    "--max-running-requests N to change it)")
    if getattr(cfg, "enable_watermark", False):
        raise ValueError("dspark-sgl DSPARK does not support --enable-watermark: the watermark replaces how tokens "
                         "are drawn, which speculative verification cannot reproduce; drop one of the two")
    logger.info("dspark-sgl DSPARK: draft %s, block size %d", cfg.speculative_draft_model_path, draft.block_size)


def allow_block_verification_off_cuda(original, server_args) -> None:
    """AROUND `handle_speculative_decoding`: SGLang refuses --speculative-use-block-verification off CUDA because
    its kernels are CUDA-only; our acceptance rules are plain torch, so DSPARK keeps the flag on any device."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    ours = (
        (cfg.speculative_algorithm or "").upper() == "DSPARK"
        and cfg.speculative_use_block_verification
        and not str(cfg.device or "cuda").startswith("cuda")
    )
    if not ours:
        return original(server_args)
    declare_resolution(server_args, SOURCE, speculative_use_block_verification=False)  # hide it from the check
    original(server_args)
    declare_resolution(server_args, SOURCE, speculative_use_block_verification=True)
