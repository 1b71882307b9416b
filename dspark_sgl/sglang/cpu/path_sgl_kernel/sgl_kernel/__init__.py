"""`sgl_kernel` for a CPU: the pure-torch ops of dspark_sgl.sglang.cpu.kernels under the names SGLang imports.

On PYTHONPATH only for a CPU server whose real `sgl_kernel` does not import (dspark_sgl.sglang.cpu.server_env decides;
on CUDA the real kernels are used and this folder is never on the path). Any other name resolves to a stub that raises
on call, so an op this stand-in lacks shows up as one clear error naming it.
"""

from __future__ import annotations

from dspark_sgl.sglang.cpu.kernels import (  # noqa: F401 - re-exported for SGLang
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+dspark-cpu-standin"


class _Missing:
    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} is not in dspark-sgl's CPU stand-in (dspark_sgl/sglang/cpu/kernels.py)"
        )


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
