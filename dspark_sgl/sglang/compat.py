"""DSPARK on an SGLang without a builtin DSPARK (before 0.5.23): register the name as a plugin algorithm.

Untested here (CI pins 0.5.23, which has the builtin). SGLang 0.5.23's `CustomSpecAlgo` lacks a few methods the
scheduler calls, so the spec class supplies them.
"""

from __future__ import annotations


def register_dspark(worker_cls: type, handle_args) -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DSparkSpecAlgo(CustomSpecAlgo):
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, **_):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens)

        def handle_server_args(self, server_args) -> None:
            handle_args(server_args)

    SpeculativeAlgorithm.register("DSPARK", supports_overlap=False, spec_class=DSparkSpecAlgo)(
        lambda server_args: worker_cls
    )
