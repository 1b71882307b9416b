"""Feature sources: where the trainer's batches of (ids, loss mask, aux hidden, last hidden) come from.

Placement, chosen in the recipe:

  inprocess      the rank calls HFTarget directly (no copy, no serialisation; the CPU default)
  colocated      each rank starts its own engine process on its device and streams from it (ipc://)
  disaggregated  engines run elsewhere (`python -m training.engine_server`), every rank streams from all of them

Every source returns the same `objective.Batch`, checked finite before the trainer touches it.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from dspark_sgl.config import DSparkConfig
from dspark_sgl.dtypes import DTYPES
from dspark_sgl.sglang.engine import EngineError, check_sglang_importable
from training.data import Sample, collate
from training.engine_server import EngineSupervisor
from training.objective import Batch, Teacher, sparse_teacher
from training.recipe import Recipe
from training.stream import DistPlane, Request, ShmPlane, StreamClient
from training.target import default_device, load_hf_target


def check_finite(aux: torch.Tensor, last: torch.Tensor, keys) -> None:
    if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
        raise EngineError(f"the target engine returned non-finite hidden states for samples {list(keys)}; "
                          "nothing was trained on them and no checkpoint was written")


class InProcessSource:
    """The rank's own HFTarget: capture on demand, no serialisation."""

    def __init__(self, target, pad_id: int):
        self.target, self.pad_id = target, pad_id

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        pass

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        ids, mask, lengths, sids = collate([s for _, s in items], self.pad_id)
        attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        out = self.target.capture(ids.to(self.target.device), attn.to(self.target.device))
        check_finite(out.aux, out.last_hidden, sids.tolist())
        return Batch(ids, mask, lengths, sids, out.aux, out.last_hidden).to(device)

    def pending(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class StreamSource:
    """Features from engine processes over the stream (colocated or disaggregated)."""

    def __init__(self, client: StreamClient, pad_id: int, dtype: torch.dtype):
        self.client, self.pad_id, self.dtype = client, pad_id, dtype

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        self.client.submit([Request(k, s.input_ids) for k, s in items])

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        ids, mask, lengths, sids = collate([s for _, s in items], self.pad_id)
        self.submit(items)
        feats = [self.client.get(k) for k, _ in items]
        S = ids.shape[1]
        where = feats[0].aux.device  # a dist plane over NCCL delivers on the rank's GPU: build the batch there
        aux = torch.zeros(len(items), S, feats[0].aux.shape[-1], dtype=self.dtype, device=where)
        last = torch.zeros(len(items), S, feats[0].last.shape[-1], dtype=self.dtype, device=where)
        for b, f in enumerate(feats):
            if f.aux.shape[0] != int(lengths[b]):
                raise EngineError(f"engine returned {f.aux.shape[0]} rows for a {int(lengths[b])}-token sample")
            aux[b, : f.aux.shape[0]], last[b, : f.last.shape[0]] = f.aux, f.last
        for k, _ in items:
            self.client.release(k)  # copied out: a shm region goes back to the ring
        check_finite(aux, last, sids.tolist())
        return Batch(ids, mask, lengths, sids, aux, last).to(device)

    def pending(self) -> list[int]:
        return self.client.pending_ids()

    def close(self) -> None:
        led = self.client.ledger
        twice = sorted(k for k, n in led.delivered.items() if n != 1)
        print(f"[stream] ledger: {len(led.delivered)} keys delivered, {len(twice)} more than once {twice[:10]}, "
              f"{led.resends} re-sent, {led.duplicates_dropped} duplicates dropped, "
              f"{len(self.client.wanted)} still wanted", flush=True)
        self.client.close()


class MemoryCachedSource:
    """A source whose captures are kept in RAM, up to a byte budget, for the epochs that follow.

    The target is frozen, so a sample's features never change: a small run that revisits its samples for several
    epochs (the CPU recipe) need not pay the target prefill again. Nothing touches the disk; samples beyond the budget
    are simply captured again. Off by default: a re-captured sample may differ in the last bit from its cached copy
    (other batch padding), and exact-resume runs want every capture taken the same way.
    """

    def __init__(self, inner, budget_bytes: int):
        self.inner, self.budget, self.used = inner, budget_bytes, 0
        self.cache: dict[int, tuple] = {}
        # objective.teacher_topk > 0: the trainer sets (lm_head weight, k) once the target head is loaded; a sample's
        # sparse teacher is then computed once, at capture, and kept instead of its post-norm hidden states.
        self.teacher_head: tuple[torch.Tensor, int] | None = None

    def _teacher(self, last: torch.Tensor, mask: torch.Tensor) -> Teacher:
        """The sparse teacher at the positions whose next token is supervised (the rows the objective reads)."""
        weight, k = self.teacher_head
        need = torch.zeros_like(mask)
        need[:-1] = mask[1:]
        n = last.shape[0]
        out = Teacher(torch.zeros(n, k, dtype=torch.long), torch.zeros(n, k), torch.ones(n))
        if need.any():
            t = sparse_teacher(last[need].to(weight.device), weight, k)
            out.ids[need], out.probs[need], out.rest[need] = t.ids.cpu(), t.probs.cpu(), t.rest.cpu()
        return out

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @pad_id.setter
    def pad_id(self, value: int) -> None:
        self.inner.pad_id = value

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        self.inner.submit([it for it in items if it[1].id not in self.cache])

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        missing = [it for it in items if it[1].id not in self.cache]
        rows = {}
        if missing:
            fresh = self.inner.batch(missing, "cpu")
            for b, (_, s) in enumerate(missing):
                n = int(fresh.lengths[b])
                mask = fresh.loss_mask[b, :n]
                last = (fresh.last_hidden[b, :n].clone() if self.teacher_head is None else
                        self._teacher(fresh.last_hidden[b, :n], mask))
                rows[s.id] = (fresh.input_ids[b, :n], mask, fresh.aux_hidden[b, :n].clone(), last)
                size = sum(t.numel() * t.element_size() for t in _tensors(rows[s.id]))
                if self.used + size <= self.budget:
                    self.cache[s.id], self.used = rows[s.id], self.used + size
        rows.update({s.id: self.cache[s.id] for _, s in items if s.id not in rows})
        return stack_rows([rows[s.id] for _, s in items], [s.id for _, s in items], self.pad_id).to(device)

    def pending(self) -> list[int]:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


def _tensors(row: tuple) -> list[torch.Tensor]:
    *head, last = row
    return [*head, *((last.ids, last.probs, last.rest) if isinstance(last, Teacher) else (last,))]


def _pad_stack(parts: list[torch.Tensor], S: int, fill=0) -> torch.Tensor:
    out = torch.full((len(parts), S, *parts[0].shape[1:]), fill, dtype=parts[0].dtype)
    for b, t in enumerate(parts):
        out[b, : t.shape[0]] = t
    return out


def stack_rows(rows, sample_ids: list[int], pad_id: int) -> Batch:
    """Right-padded Batch from per-sample (ids, mask, aux, last hidden or sparse Teacher) rows."""
    S = max(r[0].shape[0] for r in rows)
    ids, mask, aux = (_pad_stack([r[i] for r in rows], S, fill) for i, fill in ((0, pad_id), (1, False), (2, 0)))
    lengths = torch.tensor([r[0].shape[0] for r in rows])
    lasts = [r[3] for r in rows]
    if isinstance(lasts[0], Teacher):
        teacher = Teacher(_pad_stack([t.ids for t in lasts], S), _pad_stack([t.probs for t in lasts], S),
                          _pad_stack([t.rest for t in lasts], S, 1.0))
        return Batch(ids, mask, lengths, torch.tensor(sample_ids), aux, None, teacher)
    return Batch(ids, mask, lengths, torch.tensor(sample_ids), aux, _pad_stack(lasts, S))


def make_source(recipe: Recipe, dcfg: DSparkConfig, rank: int, local_rank: int, world: int, pad_id: int,
                recipe_path: str | None, overrides: list[str], out_dir: Path):
    """(source, engine processes this rank owns, target or None)."""
    e = recipe.engine
    if e.kind == "sglang" and e.placement == "colocated" and not e.sglang_url:
        check_sglang_importable()  # a colocated engine starts sglang.Engine in this Python; remote ones have theirs
    device = default_device(e.device, local_rank)
    if e.placement == "inprocess":
        if e.kind != "hf":
            raise EngineError("engine.placement=inprocess is only possible with engine.kind=hf")
        target = load_hf_target(recipe, dcfg.target_layer_ids, device)
        return cached(recipe, InProcessSource(target, pad_id)), [], target
    procs = []
    if e.placement == "colocated":
        bind = f"ipc://{out_dir.resolve()}/engine-{rank}.sock"
        procs.append(EngineSupervisor(recipe_path, overrides, bind, out_dir / "logs" / f"engine-{rank}.log"))
        endpoints = [bind]
    else:
        endpoints = e.endpoints
    dtype = DTYPES[recipe.stream.wire_dtype]
    plane = make_plane(recipe, device)
    if plane is not None:  # raw model-dtype rows; `auto` may resolve differently on the engine: size for fp32
        wire = DTYPES.get(recipe.target.dtype, torch.float32)
        dtype = torch.float32 if recipe.target.dtype == "auto" else wire
    per_token = (dcfg.num_aux + 1) * dcfg.hidden_size * dtype.itemsize
    client = StreamClient(endpoints, per_token, credits=recipe.stream.credits,
                          byte_budget=int(recipe.stream.byte_budget_mb * 2**20), timeout_s=recipe.stream.timeout_s,
                          on_silence=procs[0].revive if procs else None, plane=plane, hidden_size=dcfg.hidden_size)
    return cached(recipe, StreamSource(client, pad_id, dtype)), procs, None


def make_plane(recipe: Recipe, device: torch.device):
    """The tensor data plane of `recipe.transport` for this rank (None: rows travel in the stream's frames)."""
    t = recipe.transport
    if t.kind == "shm":
        return ShmPlane(int(recipe.stream.byte_budget_mb * 2**20))
    if t.kind == "dist":
        backend = t.backend if t.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        host = t.host or socket.gethostbyname(socket.gethostname())
        return DistPlane(host, backend, recipe.stream.timeout_s, device=str(device))
    return None


def cached(recipe: Recipe, source):
    """The source behind a RAM cache when the recipe keeps captures or computes a sparse teacher from them."""
    mb = recipe.stream.memory_cache_mb
    return MemoryCachedSource(source, int(mb * 2**20)) if mb > 0 or recipe.objective.teacher_topk else source
