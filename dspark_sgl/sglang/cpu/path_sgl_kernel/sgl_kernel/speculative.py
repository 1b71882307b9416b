"""`sgl_kernel.speculative` for a CPU (NGRAM's tree metadata)."""

from dspark_sgl.sglang.cpu.kernels import reconstruct_indices_from_tree_mask  # noqa: F401 - re-exported for SGLang
