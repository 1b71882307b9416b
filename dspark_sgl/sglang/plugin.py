"""`sglang.srt.plugins` entry point: `--speculative-algorithm DSPARK` runs this project's worker.

SGLang 0.5.23 ships a builtin DSPARK whose name is reserved, so we take it over through SGLang's HookRegistry:
REPLACE the worker class that `SpeculativeAlgorithm.create_worker` imports at call time
(`...dspark_components.dspark_worker_v2.DSparkWorkerV2`) and the argument handler that `handle_server_args`
imports at call time (`...arg_groups.speculative_hook._handle_dspark`, which refuses CPU). On an SGLang without a
builtin DSPARK the name is registered directly. Whatever the algorithm (plain, NGRAM, DSPARK), every server that loads
the plugin also gets the request guard (guard.py): a request SGLang would pass unchecked to its scheduler, where it
would end the server, is refused with a 400.

Switch back to the builtin: leave `dspark` out of SGLANG_PLUGINS (SGLang's own plugin whitelist, e.g.
`SGLANG_PLUGINS=none`); SGLang then never loads this plugin in any process (nor its guard).
"""

from __future__ import annotations

import os
import sys

PLUGIN_NAME = "dspark"  # the entry-point name SGLANG_PLUGINS matches
WORKER_TARGET = "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2"
ARGS_TARGET = "sglang.srt.arg_groups.speculative_hook._handle_dspark"
VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
EXPAND_TARGET = "sglang.srt.managers.io_struct.GenerateReqInput._handle_parallel_sampling"
SIZE_TARGET = "sglang.srt.managers.io_struct.GenerateReqInput._determine_batch_size"
BODY_TARGET = "sglang.srt.entrypoints.http_server.ORJSONRequest.json"  # the HTTP server's JSON parse
SPEC_ARGS_TARGET = "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding"
# Live draft updates (weights.py): a DSpark draft folder sent to /update_weights_from_disk loads into the draft only,
# and does not rename the served model.
DISK_UPDATE_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
                      "update_weights_from_disk")
MODEL_PATH_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._update_model_path_info"
PAUSE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.pause_generation"  # a pause with a lease


def _announce(message: str) -> None:
    # load_plugins() runs before SGLang configures logging in every process, so a logger line would be dropped.
    print(f"[dspark-sgl pid={os.getpid()}] {message}", file=sys.stderr, flush=True)


def _has_builtin_dspark() -> bool:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return "DSPARK" in SpeculativeAlgorithm.__members__


def register_mla_draft_config() -> None:
    """SGLang reads the draft's config.json with AutoConfig, which does not know vLLM's `k3_dspark` model type (the
    MLA draft's layout): register a plain PretrainedConfig for it, as vLLM's own config registry does."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "k3_dspark" in CONFIG_MAPPING:
        return

    class K3DSparkConfig(PretrainedConfig):
        model_type = "k3_dspark"

    AutoConfig.register("k3_dspark", K3DSparkConfig)


def load() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from dspark_sgl.sglang.args import allow_block_verification_off_cuda, handle_dspark_args
    from dspark_sgl.sglang.capture import register_hooks as register_capture_hooks
    from dspark_sgl.sglang.guard import refuse_bad_batch, refuse_bad_body, refuse_bad_request, refuse_empty_batch
    from dspark_sgl.sglang.sampling import refuse_unsupported_request
    from dspark_sgl.sglang.weights import keep_served_model_path, lease_pause, route_disk_update
    from dspark_sgl.sglang.worker import DSparkWorker

    register_capture_hooks()  # training capture; a no-op unless the model override asks for it
    register_mla_draft_config()
    HookRegistry.register(DISK_UPDATE_TARGET, route_disk_update, HookType.AROUND)
    HookRegistry.register(MODEL_PATH_TARGET, keep_served_model_path, HookType.AROUND)
    HookRegistry.register(PAUSE_TARGET, lease_pause, HookType.AROUND)  # every server: weights.py
    HookRegistry.register(VALIDATE_TARGET, refuse_bad_request, HookType.BEFORE)  # every server: guard.py
    HookRegistry.register(EXPAND_TARGET, refuse_bad_batch, HookType.BEFORE)  # every server: guard.py
    HookRegistry.register(SIZE_TARGET, refuse_empty_batch, HookType.BEFORE)  # every server: guard.py
    HookRegistry.register(BODY_TARGET, refuse_bad_body, HookType.AROUND)  # every server: guard.py
    HookRegistry.register(VALIDATE_TARGET, refuse_unsupported_request, HookType.BEFORE)  # DSPARK servers only
    if _has_builtin_dspark():
        HookRegistry.register(WORKER_TARGET, DSparkWorker, HookType.REPLACE)
        HookRegistry.register(ARGS_TARGET, handle_dspark_args, HookType.REPLACE)
        HookRegistry.register(SPEC_ARGS_TARGET, allow_block_verification_off_cuda, HookType.AROUND)
        how = "replaces SGLang's builtin DSPARK worker and argument handler"
    else:
        from dspark_sgl.sglang.compat import register_dspark

        register_dspark(DSparkWorker, handle_dspark_args)
        how = "registers DSPARK (this SGLang has no builtin)"
    _announce(
        f"plugin {PLUGIN_NAME!r} loaded: --speculative-algorithm DSPARK runs dspark_sgl.sglang.worker.DSparkWorker "
        f"({how}); leave {PLUGIN_NAME!r} out of SGLANG_PLUGINS to get the builtin back"
    )
