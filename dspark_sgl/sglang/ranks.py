"""Every TP rank commits the same tokens: rank 0's per-step decisions, broadcast to its TP group (no-op at TP=1).

Under tensor parallelism every rank runs the whole (replicated) draft and the whole acceptance, on target logits the
lm_head all-gather has made identical. They still compute the same numbers only while every input agrees to the bit:
one near-tie broken differently by another reduction order, one random draw from a generator in another state, one
SPS table timed on another rank, and rank 1 verifies other drafts than rank 0 (its target forward then meets rank 0's
in the same all-reduces) or commits other tokens into the same sequence. So, as SGLang's builtin does
(`srt/speculative/spec_tp_sync.py`), the decisions of a decode step come from rank 0, at two points:

    before the verify : each request's draft tokens and verify length   (what the target runs on)
    after acceptance  : each request's accepted count and bonus token   (what is committed and emitted)

Everything else in the step (out tokens, context and KV commits, the hybrid state commit, the next anchor) follows
from these and the all-gathered logits. Each point is ONE broadcast of one packed int64 tensor [bs, k] (γ+1 and 2
columns: under a kilobyte at 32 requests), on the device, with no host sync. At TP=1 `share` hands back its inputs
untouched: no collective, no copy, no sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_sgl.faults import planted


class RankSync:
    """`share(a, b, ...)`: rank 0's values of per-request tensors ([bs] or [bs, k], integer) on every rank.

    `group` is anything with `world_size`, `broadcast(tensor, src)` that fills `tensor` in place on every rank
    from group-local rank `src`, `broadcast_object(obj, src)` and `all_gather_object(obj)` (SGLang's
    GroupCoordinator: its TP group); None or one rank: a no-op."""

    def __init__(self, group=None):
        self.group = group if group is not None and group.world_size > 1 else None

    @property
    def active(self) -> bool:
        return self.group is not None

    def share(self, *values: Tensor) -> tuple[Tensor, ...]:
        if self.group is None or planted("rank_sync"):
            return values
        columns = [v.reshape(v.shape[0], -1) for v in values]
        packed = torch.cat([c.long() for c in columns], 1)  # one collective for all of them
        self.group.broadcast(packed, src=0)
        out = packed.split([c.shape[1] for c in columns], 1)
        return tuple(o.to(v.dtype).reshape(v.shape) for o, v in zip(out, values, strict=True))

    def share_object(self, obj):
        """Rank 0's picklable `obj` on every rank (start-up state such as the SPS table, never per step)."""
        return obj if self.group is None else self.group.broadcast_object(obj, src=0)

    def agree(self, ok: bool, message: str) -> tuple[bool, str]:
        """Whether a rank-local action succeeded on EVERY rank: (True, message) if so, else (False, each failed
        rank's message). A live draft update is read by each rank from its own disk (another node's may lack the
        folder or hold another file); installed on some ranks only, rank 0 would report success while rank 1 served
        the old draft. One all-gather of (ok, message), at a point every rank reaches (SGLang hands each request to
        all TP ranks), never per step."""
        if self.group is None or planted("rank_agree"):
            return ok, message
        verdicts = self.group.all_gather_object((bool(ok), str(message)))
        failed = [f"rank {r}: {m}" for r, (good, m) in enumerate(verdicts) if not good]
        return (True, message) if not failed else (False, "; ".join(failed))


def tp_rank_sync() -> RankSync:
    """The worker's RankSync over SGLang's TP group (DP attention, whose groups differ, is refused in args.py)."""
    from sglang.srt.distributed import get_tp_group

    return RankSync(get_tp_group())
