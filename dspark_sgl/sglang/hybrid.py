"""Linear-attention hybrid targets (Kimi-K3 / Kimi-Linear KDA, GDN, Mamba): their recurrent state around a verify.

A TARGET_VERIFY forward does not advance a hybrid layer's committed state: the linear-attention backend writes each
verified step's SSM state and conv window into SGLang's speculative scratch (`MambaPool.SpeculativeState`
`intermediate_ssm` / `intermediate_conv_window`, or the ReplaySSM ring), and the Triton conv update also slides the
persistent conv window over the whole verify window. After acceptance the worker must commit, for each request,
the state after exactly its accepted prefix: step c of the window, where c = accepted drafts (the anchor is step 0,
so c + 1 tokens are committed). This module makes that commit with the call SGLang's own DSPARK worker makes
(`dspark_worker_v2._commit_target_mamba_states_after_verify` -> `attn_backend.update_mamba_state_after_mtp_verify`),
which picks the ReplaySSM fold, the fused-accept conv-only commit or the intermediate-state scatter, plus the
prefix-cache track slot when the mamba radix cache keeps its extra buffer.

The commit reads slot indices from the backend's forward metadata, so no other target forward may run between the
verify and `commit` (the worker commits right after acceptance). The worker's live SPS probe runs extra verifies
of the same batch; `preserved` snapshots the batch's recurrent state (committed, scratch and ring rows) and puts it
back, so a probe leaves a hybrid request exactly as it found it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from torch import Tensor

from dspark_sgl.faults import planted


def commit_step_indices(commit_lens: Tensor, seq_lens_pre: Tensor, track_interval: int | None
                        ) -> tuple[Tensor, Tensor | None]:
    """(last accepted verify step per request = commit_lens - 1, the step whose state lands on the prefix-cache
    track slot or -1, None without tracking). Chain layout; the index math of SGLang's DSPARK worker."""
    last = commit_lens.to(torch.int64) - 1
    if track_interval is None:
        return last, None
    pre = seq_lens_pre.to(torch.int64)
    post = pre + commit_lens.to(torch.int64)
    crossing = pre // track_interval != post // track_interval
    step = torch.clamp(post // track_interval * track_interval - pre - 1, min=0)
    tracked = crossing & (step < commit_lens.to(torch.int64))
    return last, torch.where(tracked, step, torch.full_like(step, -1))


def is_hybrid(model_runner) -> bool:
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_runner.model_config) is not None


class HybridState:
    """The recurrent-state side of one hybrid target, for DSparkWorker (one per worker)."""

    def __init__(self, model_runner):
        from sglang.srt.runtime_context import get_spec

        self.model_runner = model_runner  # its attention backend is built after the spec worker: looked up on use
        if get_spec().speculative_eagle_topk not in (None, 1):
            raise ValueError(f"speculative_eagle_topk={get_spec().speculative_eagle_topk}: DSPARK verifies a chain (1)")

    @property
    def backend(self):
        backend = self.model_runner.attn_backend
        if not hasattr(backend, "update_mamba_state_after_mtp_verify"):
            raise ValueError(
                f"hybrid target {self.model_runner.model_config.hf_config.architectures[0]} runs on attention "
                f"backend {type(backend).__name__}, which has no update_mamba_state_after_mtp_verify: its recurrent "
                "state cannot be committed after a verify step"
            )
        return backend

    @property
    def _pool(self):
        return self.model_runner.req_to_token_pool

    def commit(self, batch, seq_lens_pre: Tensor, commit_lens: Tensor) -> None:
        """After acceptance: fold each request's state forward by exactly commit_lens[r] = accepted + 1 tokens."""
        from sglang.srt.runtime_context import mamba_track_grid

        track = batch.mamba_track_indices
        interval = mamba_track_grid(batch.tree_cache.page_size) if track is not None else None
        last, steps_to_track = commit_step_indices(commit_lens, seq_lens_pre, interval)
        self.backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last,
            mamba_track_indices=track,
            mamba_steps_to_track=steps_to_track,
            model=self.model_runner.model,
            req_pool_indices=batch.req_pool_indices,
        )
        if planted("hybrid_state"):  # TEST ONLY (dspark_sgl/faults.py): forget the state just committed
            slots = self._slots(batch)
            for t in state_tensors(self._pool.get_speculative_mamba2_params_all_layers(), scratch=False):
                if t.is_floating_point():
                    t[:, slots] = 0

    def _slots(self, batch) -> Tensor:
        slots = self._pool.get_mamba_indices(batch.req_pool_indices)
        translate = getattr(self._pool, "translate_mamba_indices", None)
        return (translate(slots) if translate is not None else slots).long()

    def preserved(self, batch):
        """Context manager: extra verifies of `batch` (the SPS probe) leave its requests' recurrent state as found."""
        accept = getattr(getattr(self.backend, "linear_attn_backend", None), "accept_lens_pool", None)
        rows = torch.arange(len(batch.seq_lens), device=batch.seq_lens.device)
        return preserve_state(self._pool.get_speculative_mamba2_params_all_layers(), self._slots(batch), rows,
                              accept)


def state_tensors(state, scratch: bool) -> list[Tensor]:
    """The non-empty tensors of a `MambaPool.SpeculativeState`: its verify scratch (`intermediate_*`, indexed by
    batch row) when `scratch`, else its per-slot tensors (conv windows, SSM state, ReplaySSM ring)."""
    out = []
    for f in dataclasses.fields(state):
        if f.name.startswith("intermediate") != scratch:
            continue
        value = getattr(state, f.name)
        out += [t for t in (value if isinstance(value, list) else [value]) if t is not None and t.numel() > 0]
    return out


@contextmanager
def preserve_state(state, slots: Tensor, rows: Tensor, accept_lens_pool: Tensor | None = None):
    """Snapshot and restore, around the body, every per-slot tensor of a `MambaPool.SpeculativeState` (conv windows,
    SSM state, ReplaySSM ring; [layers, slots, ...]) at `slots`, its verify scratch (`intermediate_*`; [layers,
    rows, steps, ...]) at `rows`, and the fused-accept lengths at `slots`."""
    saved = [(t, slots, t[:, slots].clone()) for t in state_tensors(state, scratch=False)]
    saved += [(t, rows, t[:, rows].clone()) for t in state_tensors(state, scratch=True)]
    if accept_lens_pool is not None:
        saved.append((accept_lens_pool, slots, accept_lens_pool[slots].clone()))
    try:
        yield
    finally:
        for t, index, value in saved:
            if t.dim() == 1:
                t[index] = value
            else:
                t[:, index] = value
